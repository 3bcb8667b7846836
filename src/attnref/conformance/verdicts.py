"""The two outcomes of a check other than a pass: `Failure` and `Skip`.

Every check of the audit returns (a pass) or raises one of these; nothing a backend does
escapes as anything else (`attnref.conformance.calls`).
"""

__all__ = ["Failure", "Skip", "one_line"]


class Failure(Exception):  # noqa: N818 (a verdict on the backend, not an error of ours)
    """The backend got a check wrong; ``str(failure)`` is a one-line summary.

    ``fatal`` failures (a hang) stop the search: calling the backend again only costs time.
    """

    def __init__(
        self,
        message: str,
        *,
        got: float | None = None,
        expected: float | None = None,
        where: tuple[int, ...] | None = None,
        fatal: bool = False,
    ) -> None:
        super().__init__(message)
        self.got = got
        self.expected = expected
        self.where = where
        self.fatal = fatal


class Skip(Exception):  # noqa: N818 (a signal, like pytest.skip)
    """The backend declares it does not support this call, or (``refused``) it raised an
    error its declaration names as a refusal."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


def one_line(e: BaseException) -> str:
    """``Type: first line of the message``."""
    text = str(e).strip().splitlines()
    name = getattr(e, "type_name", type(e).__name__)  # a RemoteError: the backend's type
    return f"{name}: {text[0] if text else ''}"
