"""The built dashboard is served at / with deep links answered by index.html."""

from __future__ import annotations

from fastapi.testclient import TestClient

from hai.db.models import Base
from hai.main import create_app
from hai.services.context import Platform
from hai.settings import Settings


def test_deep_links_fall_back_to_index_but_api_and_assets_keep_404(tmp_path):
    dist = tmp_path / "dist"
    (dist / "assets").mkdir(parents=True)
    (dist / "index.html").write_text("<!doctype html><div id=root></div>")
    (dist / "assets" / "app.js").write_text("console.log(1)")
    platform = Platform.from_settings(Settings(data_dir=tmp_path / "hai", frontend_dist=dist))
    Base.metadata.create_all(platform.engine)
    try:
        with TestClient(create_app(platform)) as c:
            for path in ("/", "/jobs/12", "/nodes/n0", "/cluster"):
                r = c.get(path)
                assert r.status_code == 200 and "id=root" in r.text, path
            assert c.get("/assets/app.js").text == "console.log(1)"
            assert c.get("/assets/missing.js").status_code == 404
            r = c.get("/api/v1/nothing-here")
            assert r.status_code == 404 and r.headers["content-type"].startswith("application/json")
    finally:
        platform.close()
