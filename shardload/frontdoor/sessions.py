"""Sessions by kind, as the front door offers them (``sessions.kinds``)."""

from __future__ import annotations

from ..sessions.kinds import open_session, register_session_kind, session_kinds

__all__ = ["open_session", "register_session_kind", "session_kinds"]
