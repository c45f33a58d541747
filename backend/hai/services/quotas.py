from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from hai.db.models import Quota
from hai.schemas.common import QuotaItem
from hai.services import notify
from hai.services.errors import Invalid
from hai.services.jobs import publish_after_commit


def list_quotas(*, session: Session) -> list[Quota]:
    return list(session.scalars(select(Quota).order_by(Quota.group, Quota.priority, Quota.user_name)))


def replace_quotas(*, session: Session, items: list[QuotaItem]) -> list[Quota]:
    """Replace the whole quota table (PUT semantics), atomically."""
    seen = set()
    for i, item in enumerate(items):
        key = (item.group, item.priority.value, item.user)
        if key in seen:
            raise Invalid(f"items.{i}", f"duplicate quota for group {item.group}, priority {item.priority.value}, user {item.user}")
        seen.add(key)
    session.execute(delete(Quota))
    for item in items:
        session.add(Quota(group=item.group, priority=item.priority.value, user_name=item.user, gpus=item.gpus))
    publish_after_commit(session, notify.SCHEDULER)
    session.commit()
    return list_quotas(session=session)
