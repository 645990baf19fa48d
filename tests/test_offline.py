"""Without network, a hub model fails at once, on the model, in one line; `plan ALIAS` needs no network at all;
a hub text fails at once too. The hub is probed once, briefly (`compressor.runtime.hub`)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from compressor.cli import main
from compressor.runtime import hub
from compressor.runtime.errors import UserError


@pytest.fixture
def no_network(monkeypatch):
    """The hub unreachable (as the probe would find it offline), nothing in the hub client's cache, and no text
    read: the model must be refused first."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hub, "offline_by_env", lambda: None)
    monkeypatch.setattr(hub, "_verdict", {})
    monkeypatch.setattr(hub, "_probe", lambda url, seconds: f"{url}: Name or service not known")
    monkeypatch.setattr(hub, "cached_config", lambda repo, revision: False)

    def no_text(*args, **kwargs):
        raise AssertionError("a text was read before the model was checked")

    monkeypatch.setattr("compressor.api.session.load_documents", no_text)
    monkeypatch.setattr("compressor.api.run.load_documents", no_text)


def _fails(argv, capsys) -> tuple[int, str]:
    """Exit code and stderr of `main(argv)`. Fast means no retry loop and no download attempted (the probe is
    mocked, any other network access would hang or fail here); the wall time of a fresh process without
    network is measured by hand and stated in docs/options.md, not asserted (timings belong to benchmarks)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("argv", [["llama-3.2-1b", "--ratio", "0.2"], ["inspect", "llama-3.2-1b"]])
def test_hub_model_without_network_fails_at_once_on_the_model(argv, no_network, capsys):
    code, err = _fails(argv, capsys)
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith(
        "error: llama-3.2-1b needs 'meta-llama/Llama-3.2-1B' from the Hugging Face hub, which cannot be reached"
    ), err
    assert "pass the local directory, or a .gguf file" in err and "WikiText" not in err


def test_a_hub_id_without_network_fails_in_one_line(no_network, capsys):
    code, err = _fails(["plan", "Qwen/Qwen2.5-7B"], capsys)  # no recipe carries its shapes
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(
        "error: 'Qwen/Qwen2.5-7B' is a model on the Hugging Face hub, and the hub cannot be"
    )


def test_hf_hub_offline_is_honoured_without_a_probe(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "cached_config", lambda repo, revision: False)
    monkeypatch.setattr(
        hub, "_probe", lambda url, seconds: pytest.fail("probed although HF_HUB_OFFLINE is set")
    )
    code, err = _fails(["eval", "qwen2.5-0.5b"], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "qwen2.5-0.5b needs 'Qwen/Qwen2.5-0.5B'" in err and "HF_HUB_OFFLINE is set" in err


def test_a_cached_hub_model_loads_from_the_cache(no_network, monkeypatch):
    from compressor.api.model_loading import read_config, resolve_model

    monkeypatch.setattr(hub, "cached_config", lambda repo, revision: repo == "Qwen/Qwen2.5-0.5B")
    source = resolve_model("qwen2.5-0.5b")
    hub.check_hub_model(source)
    assert source.local_only
    seen = {}

    def from_pretrained(location, **kwargs):
        seen.update(kwargs, location=location)
        raise OSError("stop here")

    monkeypatch.setattr("transformers.AutoConfig.from_pretrained", from_pretrained)
    with pytest.raises(UserError):
        read_config(source)
    assert seen == {"location": "Qwen/Qwen2.5-0.5B", "local_files_only": True}


@pytest.mark.parametrize("model", ["llama-3.2-1b", "meta-llama/Llama-3.2-1B"])
def test_plan_of_a_recipe_model_needs_no_network(model, no_network, monkeypatch, capsys):
    monkeypatch.setattr(hub, "_probe", lambda url, seconds: pytest.fail("plan probed the hub"))
    monkeypatch.setattr(
        "transformers.AutoConfig.from_pretrained", lambda *a, **k: pytest.fail("plan fetched the config")
    )
    capsys.readouterr()
    main(["plan", model, "--ratio", "0.2", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["config_source"].startswith("recipe llama-3.2-1b")
    assert plan["num_layers"] == 16 and plan["model_params_before"] == 1_235_814_400
    assert plan["feasible"]


def test_a_hub_text_without_network_fails_at_once(no_network, monkeypatch):
    from compressor.calibration.sources import load_documents

    monkeypatch.setattr(
        "datasets.load_dataset", lambda *a, **k: pytest.fail("datasets asked the hub"), raising=False
    )
    start = time.perf_counter()
    with pytest.raises(UserError) as excinfo:
        load_documents("wikitext2", "calibration")
    assert "cannot be reached" in str(excinfo.value) and "HF_HUB_OFFLINE=1" in str(excinfo.value)
    assert time.perf_counter() - start < 3


def test_the_probe_decides_fast(monkeypatch):
    def refused(request, timeout):
        raise urllib.error.URLError(ConnectionRefusedError(111, "Connection refused"))

    monkeypatch.setattr(urllib.request, "urlopen", refused)
    assert hub._probe("https://hub.example", 1.0) == "https://hub.example: Connection refused"

    def answered(request, timeout):
        raise urllib.error.HTTPError(request.full_url, 404, "Not Found", {}, None)

    monkeypatch.setattr(urllib.request, "urlopen", answered)
    assert hub._probe("https://hub.example", 1.0) is None  # any answer: reachable

    monkeypatch.setattr(urllib.request, "urlopen", lambda request, timeout: time.sleep(5))
    start = time.perf_counter()
    assert hub._probe("https://hub.example", 0.2) == "no answer from https://hub.example within 0.2 s"
    assert time.perf_counter() - start < 1


def test_the_probe_runs_once_per_process(monkeypatch):
    calls = []
    monkeypatch.setattr(hub, "offline_by_env", lambda: None)
    monkeypatch.setattr(hub, "_verdict", {})
    monkeypatch.setattr(hub, "_probe", lambda url, seconds: calls.append(url) or "unreachable")
    assert hub.unreachable() == hub.unreachable() == "unreachable"
    assert len(calls) == 1
