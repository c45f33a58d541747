from __future__ import annotations

import pytest
from pydantic import ValidationError

from hai.settings import Settings


def test_sections_read_from_environment(monkeypatch):
    monkeypatch.setenv("HAI_SCHEDULER__MIN_RUNTIME_S", "42")
    monkeypatch.setenv("HAI_SCHEDULER__QUANTUM_S", "7200")
    monkeypatch.setenv("HAI_AGENT__LOST_AFTER_S", "12.5")
    monkeypatch.setenv("HAI_DB__URL", "postgresql+psycopg://u@h/db")
    s = Settings()
    assert (s.scheduler.min_runtime_s, s.scheduler.quantum_s, s.agent.lost_after_s) == (42, 7200, 12.5)
    assert s.database_url == "postgresql+psycopg://u@h/db"


def test_embedded_default_is_sqlite_under_data_dir(tmp_path):
    s = Settings(data_dir=tmp_path)
    assert s.database_url == f"sqlite:///{tmp_path / 'hai.db'}"


@pytest.mark.parametrize("secret", ["changeme", "admin", "short"])
def test_default_secrets_refused_outside_development(secret):
    with pytest.raises(ValidationError, match="refused outside development"):
        Settings(environment="production", auth={"bootstrap_admin_token": secret})
    Settings(environment="development", auth={"bootstrap_admin_token": secret})  # fine locally


def test_invalid_durations_are_refused():
    with pytest.raises(ValidationError):
        Settings(scheduler={"interval_s": 0})


def test_every_policy_knob_is_a_scheduler_setting_with_the_policys_default():
    from dataclasses import fields

    from hai.domain.scheduler import Policy

    s = Settings().scheduler
    for f in fields(Policy):
        assert getattr(s, f.name) == f.default, f.name
    assert s.policy() == Policy()


def test_preemption_time_sharing_and_the_cap_are_read_from_the_environment(monkeypatch):
    from hai.services.scheduling import policy_from_settings

    monkeypatch.setenv("HAI_SCHEDULER__PREEMPTION", "false")
    monkeypatch.setenv("HAI_SCHEDULER__TIME_SHARING", "false")
    monkeypatch.setenv("HAI_SCHEDULER__MAX_PREEMPTIONS_PER_CYCLE", "5")
    p = policy_from_settings(Settings())
    assert (p.preemption, p.time_sharing, p.max_preemptions_per_cycle) == (False, False, 5)
    with pytest.raises(ValidationError):
        Settings(scheduler={"max_preemptions_per_cycle": -1})


def test_the_cli_s_own_variables_are_not_read_as_settings_sections(monkeypatch):
    """HAI_SERVER and HAI_TOKEN (the CLI's server URL and credential, set in every shell that uses
    `hai`) share the settings' prefix: no settings section may be named after them, or every
    command that loads the settings with them set fails to parse them (a `server` section did)."""
    monkeypatch.setenv("HAI_SERVER", "http://127.0.0.1:8080")
    monkeypatch.setenv("HAI_TOKEN", "hai_not-a-real-token")
    monkeypatch.setenv("HAI_HTTP__ACCESS_LOG", "false")
    s = Settings()
    assert s.http.access_log is False
    assert not {"server", "token"} & set(Settings.model_fields)
