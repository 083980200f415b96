"""Hub names served from real Hugging Face caches, offline.

Each cache is written by huggingface_hub's own helpers (hf_cache_layout.py) and first read back
by huggingface_hub itself; then servelm resolves `ORG/NAME[:TAG][@REVISION]` from it, serves
it, lists it, and says in one line why it cannot when it cannot. No hub server is faked: the
online path is reached only up to a refused connection.
"""

import argparse
import errno
import shutil

import pytest
from hf_cache_layout import commit_hash, put_snapshot
from huggingface_hub import errors as hf_errors

from servelm.loader import ModelNotFoundError, load_model_config, resolve_model
from servelm.loader import hub_cache
from servelm.loader.hub_ref import HubModelError, HubRef
from servelm.protocol import SamplingParams

TINY = "test-org/tiny-llama"
GGUF = "test-org/smol-gguf"
MAIN, V1 = commit_hash("main"), commit_hash("v1")
Q4_1 = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hf-hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    hub_cache._fetch_cached.cache_clear()
    yield cache
    hub_cache._fetch_cached.cache_clear()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tiny_models import make_tiny_hf_model, save_tiny_checkpoint

    return save_tiny_checkpoint(make_tiny_hf_model("llama"), tmp_path_factory.mktemp("tiny"))


def _files(folder):
    return {p.name: p for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture
def tiny_repo(hf_cache, tiny_dir):
    """The tiny checkpoint at MAIN, and without generation_config.json at V1 (tag v1); the
    repository listing also holds files servelm never fetches."""
    files = _files(tiny_dir)
    main = put_snapshot(hf_cache, TINY, files, commit=MAIN, listed_only={
        "README.md": 120, "pytorch_model.bin": 10**6, "model-Q4_1.gguf": 10**6})
    files.pop("generation_config.json")
    v1 = put_snapshot(hf_cache, TINY, files, commit=V1, refs=("v1",))
    return main, v1


@pytest.fixture
def gguf_repo(hf_cache, default_model_path):
    """The default model's Q4_1 GGUF among other quantizations of distinct content."""
    return put_snapshot(hf_cache, GGUF, {
        Q4_1: default_model_path,
        "SmolLM2-135M-Instruct.Q8_0.gguf": b"GGUF" + b"\x08" * 64,
        "SmolLM2-135M-Instruct.Q4_K_M.gguf": b"GGUF" + b"\x0f" * 64,
        "README.md": b"# smol\n",
    }, commit=MAIN)


def test_cache_layout_reads_back_with_huggingface_hub(tiny_repo, hf_cache, tiny_dir):
    from huggingface_hub import (
        get_cached_repo_tree,
        scan_cache_dir,
        snapshot_download,
        try_to_load_from_cache,
    )

    main, v1 = tiny_repo
    assert try_to_load_from_cache(TINY, "config.json", cache_dir=hf_cache) == str(
        main / "config.json")
    assert try_to_load_from_cache(TINY, "config.json", cache_dir=hf_cache,
                                  revision="v1") == str(v1 / "config.json")
    folder = snapshot_download(TINY, cache_dir=hf_cache, local_files_only=True,
                               allow_patterns=["*.json", "*.safetensors"])
    assert folder == str(main.resolve())
    (repo,) = scan_cache_dir(hf_cache).repos
    assert repo.repo_id == TINY and repo.repo_type == "model"
    revisions = {r.commit_hash: r for r in repo.revisions}
    assert set(revisions) == {MAIN, V1}
    assert revisions[MAIN].refs == {"main"} and revisions[V1].refs == {"v1"}
    assert {f.file_name for f in revisions[MAIN].files} == set(_files(tiny_dir))
    listed = {f.path for f in get_cached_repo_tree(TINY, cache_dir=hf_cache)}
    assert listed == set(_files(tiny_dir)) | {"README.md", "pytorch_model.bin", "model-Q4_1.gguf"}
    weights = main / "model.safetensors"
    assert weights.is_symlink() and weights.resolve().parent.name == "blobs"
    assert weights.read_bytes() == (tiny_dir / "model.safetensors").read_bytes()


def test_hub_name_serves_offline_as_its_directory(tiny_repo, tiny_dir):
    from servelm.llm import LLM

    main, _ = tiny_repo
    assert resolve_model(TINY) == ("hf", main, TINY)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    kw = dict(num_blocks=64, block_size=4)
    hub = LLM(TINY, **kw).generate("w5 w17 w99", params, use_tqdm=False)[0].outputs[0]
    local = LLM(str(tiny_dir), **kw).generate("w5 w17 w99", params, use_tqdm=False)[0].outputs[0]
    assert len(hub.token_ids) == 8 and hub.token_ids == local.token_ids


def test_revision_resolves_a_ref_or_a_commit(tiny_repo, hf_cache):
    main, v1 = tiny_repo
    assert resolve_model(f"{TINY}@v1") == ("hf", v1, f"{TINY}@v1")
    assert resolve_model(f"{TINY}@{MAIN}").path == main
    assert resolve_model(f"{TINY}@main").path == main
    assert not (resolve_model(f"{TINY}@v1").path / "generation_config.json").exists()
    with pytest.raises(HubModelError, match="revision 'v2' is not in the Hugging Face cache"):
        resolve_model(f"{TINY}@v2")


def test_gguf_tag_picks_its_file(gguf_repo, default_model_path):
    source = resolve_model(f"{GGUF}:Q4_1")
    assert source == ("gguf", gguf_repo / Q4_1, f"{GGUF}:Q4_1")
    assert source.path.read_bytes()[:4096] == default_model_path.read_bytes()[:4096]
    assert resolve_model(f"{GGUF}:q4_1").path == gguf_repo / Q4_1
    assert resolve_model(f"{GGUF}:SmolLM2-135M-Instruct.Q8_0.gguf").path.name.endswith("Q8_0.gguf")
    assert resolve_model(GGUF).path.name == "SmolLM2-135M-Instruct.Q4_K_M.gguf"  # llama.cpp's
    expected = load_model_config(resolve_model(str(default_model_path)))
    assert load_model_config(source) == expected.replace(name=f"{GGUF}:Q4_1")


def test_gguf_hub_name_generates(gguf_repo):
    from servelm.llm import LLM

    llm = LLM(f"{GGUF}:Q4_1", kv_cache_memory=16 * 2**20, max_model_len=256)
    out = llm.generate("The capital of France is",
                       SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.text.strip()


def test_not_cached_offline_is_one_clear_line(hf_cache):
    from servelm.llm import LLM

    for call in (resolve_model, LLM):
        with pytest.raises(ModelNotFoundError) as err:
            call("test-org/absent")
        e = err.value
        assert isinstance(e, HubModelError) and isinstance(e, ValueError)
        assert e.param == "model" and e.code == "model_not_cached"
        message = str(e)
        assert message.startswith("model 'test-org/absent': ") and "\n" not in message
        assert "HF_HUB_OFFLINE" in message and str(hf_cache) in message
        assert "servelm models pull test-org/absent" in message


def test_a_listed_file_missing_from_the_snapshot_is_not_cached(hf_cache, tiny_dir):
    files = _files(tiny_dir)
    files.pop("model.safetensors")
    put_snapshot(hf_cache, TINY, files, commit=MAIN,
                 listed_only={"model.safetensors": 10**5})
    with pytest.raises(HubModelError, match=r"missing model\.safetensors") as err:
        resolve_model(TINY)
    assert err.value.code == "model_not_cached"


def test_no_supported_format_lists_the_repo_files(hf_cache):
    put_snapshot(hf_cache, "test-org/pickled", {
        "config.json": b"{}", "pytorch_model.bin": b"\x80\x02", "README.md": b"# x\n"},
        commit=MAIN, listed_only={"tf_model.h5": 10})
    with pytest.raises(HubModelError) as err:
        resolve_model("test-org/pickled")
    message = str(err.value)
    assert err.value.code == "model_format_unsupported" and "\n" not in message
    for name in ("config.json", "pytorch_model.bin", "README.md", "tf_model.h5"):
        assert name in message


def test_an_existing_path_wins_over_a_hub_name(tiny_repo, tiny_dir, tmp_path, monkeypatch):
    local = tmp_path / "test-org" / "tiny-llama"
    shutil.copytree(tiny_dir, local)
    monkeypatch.chdir(tmp_path)
    assert resolve_model(TINY) == ("hf", local, "tiny-llama")


def test_unreachable_hub_falls_back_to_the_cache(tiny_repo, hf_cache, monkeypatch):
    """HF_HUB_OFFLINE unset and nothing listening at the endpoint: the real download path
    runs until its connection is refused, then the cache answers."""
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    main, _ = tiny_repo
    assert resolve_model(TINY).path == main
    with pytest.raises(HubModelError, match="the Hub could not be reached") as err:
        resolve_model("test-org/absent")
    assert err.value.code == "model_not_cached" and "\n" not in str(err.value)


def _cli(*argv):
    from servelm.loader.cli import add_parser

    parser = argparse.ArgumentParser(prog="servelm")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_pull_and_list(tiny_repo, gguf_repo, hf_cache, capsys):
    main, v1 = tiny_repo
    put_snapshot(hf_cache, "test-org/pickled", {"config.json": b"{}", "x.bin": b"x"},
                 commit=MAIN)
    assert _cli("models", "pull", f"{TINY}@v1", "--quiet") == 0
    assert capsys.readouterr().out.strip() == str(v1)
    assert _cli("models", "pull", f"{GGUF}:Q4_1") == 0
    assert capsys.readouterr().out.strip() == str(gguf_repo / Q4_1)
    assert _cli("models", "pull", "test-org/absent") == 1
    err = capsys.readouterr().err
    assert err.startswith("error: model 'test-org/absent': ") and err.count("\n") == 1
    assert _cli("models", "list") == 0
    listed = {line.split("\t")[0]: line.split("\t")[-1]
              for line in capsys.readouterr().out.splitlines() if "\t" in line}
    assert listed[TINY] == str(main) and listed[f"{TINY}@v1"] == str(v1)
    for name in (Q4_1, "SmolLM2-135M-Instruct.Q8_0.gguf", "SmolLM2-135M-Instruct.Q4_K_M.gguf"):
        assert listed[f"{GGUF}:{name}"] == str(gguf_repo / name)
    assert not any(name.startswith("test-org/pickled") for name in listed)


def _http_error(cls, status):
    import httpx2

    request = httpx2.Request("GET", "https://huggingface.co/api/models/org/name")
    response = httpx2.Response(status, request=request)
    return cls(f"{status} Client Error.\nmore detail", response=response)


@pytest.mark.parametrize("make, token, says, code", [
    (lambda: _http_error(hf_errors.GatedRepoError, 403), None,
     "is gated; accept its terms at https://huggingface.co/org/name, then set HF_TOKEN",
     "model_gated"),
    (lambda: _http_error(hf_errors.GatedRepoError, 403), "hf_x",
     "the token in use (HF_TOKEN) has no access", "model_gated"),
    (lambda: _http_error(hf_errors.RepositoryNotFoundError, 404), None,
     "no repository org/name on the Hugging Face Hub (if it is private, set HF_TOKEN)",
     "model_not_found"),
    (lambda: _http_error(hf_errors.RevisionNotFoundError, 404), None,
     "org/name has no revision 'v9'", "model_not_found"),
    (lambda: _http_error(hf_errors.HfHubHTTPError, 429), None,
     "the Hugging Face Hub refused org/name: HfHubHTTPError: 429 Client Error.",
     "model_fetch_failed"),
    (lambda: OSError(errno.ENOSPC, "No space left on device"), None,
     "no space left on the device while downloading org/name", "model_fetch_failed"),
    (lambda: _wrapped(OSError(errno.ENOSPC, "No space left on device")), None,
     "no space left on the device", "model_fetch_failed"),
    (lambda: hf_errors.LocalEntryNotFoundError("gone"), None,
     "is not in the Hugging Face cache", "model_not_cached"),
])
def test_hub_errors_become_one_line(make, token, says, code, tmp_path, monkeypatch):
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    else:
        monkeypatch.delenv("HF_TOKEN", raising=False)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "token"))  # none stored
    error = hub_cache._hub_error(make(), HubRef("org/name", None, "v9"), "org/name@v9",
                                 str(tmp_path))
    assert isinstance(error, HubModelError) and error.param == "model" and error.code == code
    assert says in str(error) and "\n" not in str(error)
    assert str(error).startswith("model 'org/name@v9': ")


def _wrapped(cause):
    try:
        try:
            raise cause
        except OSError as exc:
            raise RuntimeError("xet download failed") from exc
    except RuntimeError as outer:
        return outer


def test_unknown_errors_are_not_disguised(tmp_path):
    assert hub_cache._hub_error(KeyError("x"), HubRef("org/name", None, None), "org/name",
                                str(tmp_path)) is None
