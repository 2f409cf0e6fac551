"""The command line's answer to a user's mistake: its message and hint, exit code 2, never a traceback. Each row is
one mistake, run in-process through ``cli.main`` before any backend is asked (none runs at the socket here)."""

import pytest

from xdit_backend import cli


@pytest.fixture
def socket(tmp_path):
    return tmp_path / "none.sock"  # nothing answers here: a sample would start a backend, a launch check comes first


def garbage(path):
    path.write_bytes(b"not a safetensors file at all")
    return path


SAMPLE = ["sample", "--model", "flux-tiny", "--width", "64", "--height", "64", "--steps", "1"]
ROWS = [  # (argv after the socket and --out, what the message says, a file the row needs made first)
    (["--embeds", "{tmp}/missing.safetensors"], "--embeds {tmp}/missing.safetensors: no such file", None),
    (["--embeds", "{tmp}"], "--embeds {tmp}: not a file", None),
    (["--embeds", "{tmp}/bad.safetensors"], "is not a readable safetensors file", "bad.safetensors"),
    (["--latent", "{tmp}/bad.safetensors"], "--latent {tmp}/bad.safetensors is not a readable", "bad.safetensors"),
    (["--noise-mask", "{tmp}/gone.safetensors"], "--noise-mask {tmp}/gone.safetensors: no such file", None),
    (["--reference-latent", "{tmp}/gone.safetensors"], "--reference-latent {tmp}/gone.safetensors: no such", None),
    (["--ulysses", "2", "--parallel", "auto"], "and --parallel auto given together", None),
    (["--patches", "2"], "without --pipefusion", None),
    (["--shard-weights"], "--shard-weights without degrees", None),
    (["--info", "{tmp}/no/info.json"], "the folder {tmp}/no does not exist", None),
    (["--device", "cpu", "--gpus", "0,1"], "--gpus 0,1 names GPUs, but the ranks run on the CPU", None),
]


@pytest.mark.parametrize("argv,message,made", ROWS, ids=[" ".join(row[0]).replace("{tmp}/", "") for row in ROWS])
def test_a_sample_mistake_is_a_message_with_exit_code_2(argv, message, made, socket, tmp_path, capsys, monkeypatch):
    from xdit_backend.launch import launcher

    monkeypatch.setattr(launcher, "_spawn_serve", lambda *args, **kwargs: pytest.fail("a backend was started"))
    if made:
        garbage(tmp_path / made)
    argv = [part.format(tmp=tmp_path) for part in argv]
    code = cli.main([*SAMPLE, "--socket", str(socket), "--out", str(tmp_path / "out.safetensors"), *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message.format(tmp=tmp_path) in err and "hint:" in err and "Traceback" not in err
    assert not socket.exists()  # refused before any backend was started (a spawn fails the test too)


def test_cuda_where_torch_sees_none_says_so(socket, tmp_path, capsys, monkeypatch):
    """--device cuda on a machine without a usable GPU (simulated): the reason, not "--nproc must be at least 1"."""
    monkeypatch.setattr("xdit_backend.launch.options.cuda_device_count", lambda: 0)
    code = cli.main([*SAMPLE, "--socket", str(socket), "--out", str(tmp_path / "o.safetensors"), "--device", "cuda"])
    err = capsys.readouterr().err
    assert code == 2 and "--device cuda, but this machine sees no CUDA device" in err and "--nproc" not in err
    assert "use --device cpu" in err


def test_a_broken_pipe_ends_quietly(monkeypatch, capsys):
    """`xdit-backend status --json | head`: the reader leaving is not an error worth a traceback."""
    def closed(*args, **kwargs):
        raise BrokenPipeError

    monkeypatch.setattr(cli.Status, "run", lambda self, args: closed())
    monkeypatch.setattr(cli, "quiet_stdout", lambda: None)  # pytest's captured stdout has no file descriptor
    assert cli.main(["status", "--json"]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_launch_flags_that_match_the_running_backend_are_taken(monkeypatch):
    """`sample --device cuda --gpus 0,1` where a backend already runs on those GPUs: the flags are its own (a rank's
    device reads cuda:0, its GPU a physical id string), so nothing is refused; other GPUs, a count or the CPU are."""
    from argparse import Namespace
    from socket import gethostname

    from xdit_backend.errors import UsageError
    from xdit_backend.launch import options

    monkeypatch.setattr(options, "cuda_device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    host = gethostname()
    status = {"world_size": 2, "ranks": [{"device": f"cuda:{i}", "gpu": str(i), "host": host} for i in (0, 1)]}
    cli.refuse_other_launch_flags(Namespace(nproc=2, device="cuda", gpus=(0, 1)), status, "s.sock")
    for asked, said in [(dict(gpus=(2, 3)), "GPUs 0,1, this request asks for GPUs 2,3"), (dict(nproc=4), "nproc 2"),
                        (dict(device="cpu"), "device cuda")]:
        with pytest.raises(UsageError, match=said):
            cli.refuse_other_launch_flags(Namespace(**{"nproc": None, "device": None, "gpus": None, **asked}),
                                          status, "s.sock")
