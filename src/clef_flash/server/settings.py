"""What the HTTP server (app.py) and the MCP tools (mcp_tools.py) share: their settings, the API key check, the
names a request may give for the model. No web framework is imported
here: the command line builds `serve`'s and `mcp`'s flags from `ServerSettings`' fields (their `Flag`s).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..clef import Clef

MODEL_ALIASES = ("clef-flash", "@cf/cloudflare/clef-flash", "clef")
"""Names a request's `model` may give for the served model (besides none at all)."""
DEFAULT_MAX_BODY_BYTES = 1 << 20
# A body with images may be larger: the hosted 8 MiB of images as base64 (4/3) plus a text body.
DEFAULT_MAX_IMAGE_BODY_BYTES = 12 << 20
# A body with videos: 16 MiB of videos as base64 (21.3 MiB), the images' 10.7 MiB and a text body.
DEFAULT_MAX_VIDEO_BODY_BYTES = 34 << 20
API_KEY_ENVIRONMENT = "CLEF_FLASH_API_KEY"


@dataclass(frozen=True)
class Flag:
    """A setting as a flag of `clef-flash serve` (`--` and the field's name, less `_s`, with dashes), and of `mcp`
    when `mcp` is set (True: the same help; text: its help there). Its value must be positive (at least 1 for an
    integer), or 0 or more with `zero_allowed`; `env` names a variable that gives its default."""

    help: str
    mcp: str | bool = False
    zero_allowed: bool = False
    env: str | None = None


def setting(default: Any, help: str, **flag: Any) -> Any:
    return field(default=default, metadata={"flag": Flag(help, **flag)})


@dataclass(frozen=True)
class ServerSettings:
    api_key: str | None = setting(
        None,
        "require 'Authorization: Bearer KEY' on the API routes (default $CLEF_FLASH_API_KEY; unset: no key)",
        mcp="with --http: require 'Authorization: Bearer KEY' (default $CLEF_FLASH_API_KEY; unset: no key)",
        env=API_KEY_ENVIRONMENT,
    )  # when set, a matching `Authorization: Bearer` is required
    max_body_bytes: int = setting(DEFAULT_MAX_BODY_BYTES, "request body limit, also after decompression (default 1 MiB)")
    max_image_body_bytes: int = setting(
        DEFAULT_MAX_IMAGE_BODY_BYTES,
        "the body limit for a request with images (default 12 MiB: 8 MiB of images as base64, and text)",
    )
    max_video_body_bytes: int = setting(
        DEFAULT_MAX_VIDEO_BODY_BYTES,
        "the body limit for a request with videos (default 34 MiB: 16 MiB of videos as base64, images and text)",
    )
    batch_tokens: int | None = setting(None, "padded tokens per batch (default: the model's, 8192 on a CPU, 32768 on a GPU)", mcp=True)  # None: the model's
    batch_wait_ms: float = setting(
        5.0,
        "how long a request waits for others to batch with (default 5)",
        mcp="how long a call waits for others to batch with (default 5)",
        zero_allowed=True,
    )  # how long the oldest queued record waits for company
    max_batch: int = setting(64, "records per batch (default 64; 1 turns batching off)", mcp=True)
    max_queue: int = setting(
        256, "queued records before 429 + Retry-After (default 256)", mcp="queued calls before a 'busy' tool error (default 256)"
    )  # one more gets 429
    retry_after_s: int = 1
    warm_up: bool = True
    # Bodies being read, decompressed, parsed and tokenized at once (429 beyond): what bounds memory.
    max_parsing_bytes: int = setting(
        2 * DEFAULT_MAX_VIDEO_BODY_BYTES,
        "bytes of bodies being read, parsed and tokenized at once, before 429 + Retry-After; what bounds memory "
        "(default 68 MiB; at least twice --max-video-body-bytes)",
    )  # at least twice the body limits (raw + decompressed)
    max_parsing: int = 32  # requests
    request_timeout_s: float = setting(
        300.0,
        "the longest a request waits for the model, then 503 (default 300)",
        mcp="the longest a call waits for the model (default 300)",
    )
    # Deadlines of the uvicorn transport (transport.py; not enforced under other ASGI servers):
    header_timeout_s: float = setting(
        10.0, "a request's headers must arrive within this, else 408 and close (default 10)"
    )  # from a request's first byte to the end of its headers
    body_timeout_s: float = setting(
        30.0, "a request's body must arrive within this after its headers, else close (default 30)"
    )  # from the end of the headers to the end of the body
    max_connections: int = setting(1024, "open connections; one more gets 503 (default 1024)")
    shutdown_timeout_s: float = setting(
        30.0,
        "after SIGTERM, queued requests may finish for this long; then they get 503 and the process exits (default 30)",
    )
    sets_dir: str | None = None  # where POST /v1/sets/{name} finds the saved sets; None: sets.default_sets_dir()

    def __post_init__(self) -> None:
        if self.max_image_body_bytes < self.max_body_bytes:
            raise ValueError(f"max_image_body_bytes ({self.max_image_body_bytes}) must be at least max_body_bytes ({self.max_body_bytes})")
        if self.max_video_body_bytes < self.max_image_body_bytes:
            raise ValueError(
                f"max_video_body_bytes ({self.max_video_body_bytes}) must be at least max_image_body_bytes ({self.max_image_body_bytes})"
            )
        if self.max_parsing_bytes < 2 * self.max_video_body_bytes:
            raise ValueError(
                f"max_parsing_bytes ({self.max_parsing_bytes}) must be at least twice max_video_body_bytes "
                f"({self.max_video_body_bytes}): a compressed body is held with its decompressed copy"
            )
        if min(self.request_timeout_s, self.header_timeout_s, self.body_timeout_s, self.shutdown_timeout_s) <= 0:
            raise ValueError("the timeouts must be positive")

    @staticmethod
    def flags(command: str) -> dict[str, tuple[Flag, str]]:
        """The settings `command` ("serve" or "mcp") takes as flags: field name -> (its flag, its type's name)."""
        return {
            item.name: (item.metadata["flag"], str(item.type).split(" | ")[0])
            for item in fields(ServerSettings)
            if "flag" in item.metadata and (command == "serve" or item.metadata["flag"].mcp)
        }

    @staticmethod
    def from_flags(values: dict[str, Any]) -> dict[str, Any]:
        """Flag values as settings: a text body limit raised past the image or video one raises those with it."""
        raised = dict(values)
        if "max_image_body_bytes" in raised:
            raised["max_image_body_bytes"] = max(raised["max_image_body_bytes"], raised["max_body_bytes"])
            raised["max_video_body_bytes"] = max(raised["max_video_body_bytes"], raised["max_image_body_bytes"])
        return raised


# -- what every front end (HTTP, MCP) checks the same way -----------------------------------------

API_KEY_REQUIRED = "a valid API key is required: send 'Authorization: Bearer <key>'"


def bearer_matches(authorization: str | None, api_key: str) -> bool:
    """Whether an `Authorization` header carries `Bearer <api_key>` (compared in constant time)."""
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def served_names(model: Clef) -> tuple[str, ...]:
    """The names a request's `model` may give (besides none): the model's own and its aliases."""
    return tuple(dict.fromkeys((model.model_name, *MODEL_ALIASES)))

