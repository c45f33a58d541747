from __future__ import annotations

from fastapi import APIRouter, status

from hai.api.deps import AdminUser, CurrentUser, SessionDep
from hai.schemas.common import QuotaItem, QuotaList, TokenCreate, TokenCreated, TokenRead, UserRead
from hai.services import auth
from hai.services import quotas as quota_service

router = APIRouter(prefix="/api/v1", tags=["users"])


@router.get("/me", response_model=UserRead)
def me(user: CurrentUser) -> UserRead:
    return UserRead(name=user.name, group=user.group, is_admin=user.is_admin)


@router.get("/tokens", response_model=list[TokenRead])
def list_tokens(session: SessionDep, user: CurrentUser) -> list[TokenRead]:
    return [TokenRead.model_validate(t) for t in auth.list_tokens(session=session, principal=user)]


@router.post("/tokens", status_code=status.HTTP_201_CREATED, response_model=TokenCreated)
def create_token(body: TokenCreate, session: SessionDep, user: CurrentUser) -> TokenCreated:
    token, secret = auth.create_token(
        session=session, principal=user, name=body.name, expires_in_s=body.expires_in_s
    )
    return TokenCreated(**TokenRead.model_validate(token).model_dump(), token=secret)


@router.delete("/tokens/{token_id}", response_model=TokenRead)
def revoke_token(token_id: int, session: SessionDep, user: CurrentUser) -> TokenRead:
    return TokenRead.model_validate(auth.revoke_token(session=session, principal=user, token_id=token_id))


def _quota_list(rows) -> QuotaList:  # noqa: ANN001
    return QuotaList(items=[QuotaItem(group=q.group, priority=q.priority, user=q.user_name, gpus=q.gpus) for q in rows])


@router.get("/quotas", response_model=QuotaList, tags=["quotas"])
def get_quotas(session: SessionDep, _user: CurrentUser) -> QuotaList:
    return _quota_list(quota_service.list_quotas(session=session))


@router.put("/quotas", response_model=QuotaList, tags=["quotas"])
def put_quotas(body: QuotaList, session: SessionDep, _admin: AdminUser) -> QuotaList:
    return _quota_list(quota_service.replace_quotas(session=session, items=body.items))
