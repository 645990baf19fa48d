"""Is the Hugging Face hub reachable? Decided once per process, fast, so that a run without network fails at
once on what it cannot fetch (the model first), instead of after a minute of the hub client's retries.

`HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) set: offline, no probe. Otherwise one HEAD request to the hub's
endpoint (`HF_ENDPOINT`, proxies from the environment), given `PROBE_SECONDS` at most, no retry.
"""

from __future__ import annotations

import os
import threading
import urllib.error
import urllib.request

from compressor.runtime.errors import UserError

PROBE_SECONDS = 2.0
_TRUE = {"1", "on", "yes", "true"}
_verdict: dict[str, str | None] = {}  # endpoint -> why it cannot be reached (None: reachable); per process


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def offline_by_env() -> str | None:
    """The environment variable that puts the hub clients offline, when one is set (or the hub client's own
    switch, which reads it once at import)."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").strip().lower() in _TRUE:
            return f"{name} is set"
    try:
        from huggingface_hub import constants
    except ImportError:
        return None
    return "HF_HUB_OFFLINE is set" if getattr(constants, "HF_HUB_OFFLINE", False) else None


def unreachable() -> str | None:
    """Why the hub cannot be reached (the environment says offline, or the probe got no answer), or None."""
    reason = offline_by_env()
    if reason is not None:
        return reason
    url = endpoint()
    if url not in _verdict:
        _verdict[url] = _probe(url, PROBE_SECONDS)
    return _verdict[url]


def _probe(url: str, seconds: float) -> str | None:
    """One HEAD request, in a thread so that a hanging name lookup cannot hold us past `seconds`. Any HTTP
    answer, an error status included, means the hub is reachable."""
    answer: list[str | None] = []

    def ask() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=seconds).close()
            answer.append(None)
        except urllib.error.HTTPError:
            answer.append(None)
        except Exception as exc:  # no route, no name, refused, TLS: the hub is out of reach either way
            reason = getattr(exc, "reason", exc)
            answer.append(f"{url}: {getattr(reason, 'strerror', None) or reason}")

    thread = threading.Thread(target=ask, name="masa-hub-probe", daemon=True)
    thread.start()
    thread.join(seconds)
    return answer[0] if answer else f"no answer from {url} within {seconds:g} s"


def cached_config(repo: str, revision: str | None) -> bool:
    """Whether the hub client's local cache holds `repo`'s config.json (then the model may load offline)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo, "config.json", revision=revision)
    except Exception:
        return False
    return isinstance(found, str)


def check_hub_model(source) -> None:
    """For a model on the hub (`models.ModelSource` of kind "hub"): fine when the hub answers; without it,
    loadable only from the local cache (then marked `local_only`); else one line naming the model."""
    if source.kind != "hub":
        return
    reason = unreachable()
    if reason is None:
        return
    if cached_config(source.location, source.revision):
        source.local_only = True
        return
    what = (
        f"{source.spec} needs '{source.location}' from the Hugging Face hub, which"
        if source.spec != source.location
        else f"'{source.location}' is a model on the Hugging Face hub, and the hub"
    )
    raise UserError(
        f"{what} cannot be reached ({reason}): download it where there is network "
        f"(`hf download {source.location} --local-dir DIR`) and pass the local directory, or a .gguf file"
    )
