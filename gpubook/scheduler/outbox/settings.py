"""[notify]: e-mail and webhook notices' settings, declared beside the notifier (outbox/notices.py)."""

from __future__ import annotations

from dataclasses import dataclass

from gpubook.scheduler.settings import Section, checks, setting

# Every notice by default: a booker with an address learns each answer (accepted, rejected, running
# with its ssh line) as the event shows it, also from an ICS feed, which gpubook cannot write into.
EVENTS = ("accepted", "rejected", "standby", "running", "warning", "ended", "reminder", "released", "idle", "foreign")


@dataclass(frozen=True)
class EmailConfig:
    """[notify.email]: notices mailed to the booker's `email` addresses (off unless enabled)."""

    host: str = setting("localhost", "SMTP server")
    port: int = setting(25, "SMTP port", check=checks.any_port)
    security: str = setting("none", '"none", "starttls" or "tls" (SMTPS)',
                            check=checks.one_of(("none", "starttls", "tls")))
    sender: str = setting("gpubook@localhost", "From: address", check=checks.email)
    username: str | None = setting(None, "SMTP user name", sample="gpubook")
    password: str | None = setting(None, "read from password_file (mode 0600)", key="password_file",
                                   secret=True, sample="smtp-password")
    timeout_seconds: float = setting(10.0, "seconds to wait for the server", check=checks.positive)
    events: tuple[str, ...] = setting(EVENTS, "notices to send", check=checks.notice_kind)


@dataclass(frozen=True)
class WebhookConfig:
    """[notify.webhook]: one JSON POST per notice (off unless enabled)."""

    url: str = setting(help="where to POST", check=checks.http_url, sample="https://chat.lab.example/hooks/gpubook")
    token: str | None = setting(None, 'read from token_file (mode 0600); sent as "Authorization: Bearer <token>"',
                                key="token_file", secret=True, sample="webhook-token")
    timeout_seconds: float = setting(10.0, "seconds to wait for the server", check=checks.positive)
    events: tuple[str, ...] = setting(EVENTS, "notices to send", check=checks.notice_kind)


@dataclass(frozen=True)
class NotifyConfig:
    email: EmailConfig | None = setting(None, "mail; unset: off")
    webhook: WebhookConfig | None = setting(None, "webhook; unset: off")


def notify_problems(notify: NotifyConfig) -> list[tuple[str, str]]:
    email = notify.email
    if email is not None and email.username and email.security == "none":
        # Even to a loopback host: any local user may listen on its port while the relay is down.
        return [("email.security", f'is "none", but a username is set: logging in to {email.host}:{email.port} '
                 f'would send the password in clear; set security = "starttls" or "tls"')]
    return []


SECTION = Section("notify", NotifyConfig, "notices by e-mail and webhook, beside the calendar write-back; both off "
                  "unless enabled", problems=notify_problems)
