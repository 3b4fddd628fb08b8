"""Issue 31 item 1: every path argument of every command is checked in one place (`hf_ppmoe.utils.paths`) before
any work: a missing input, a file where a folder is expected (and the reverse), an output under a file or in a
folder that cannot be written end as one `hf-ppmoe COMMAND: error: ...` line with exit code 2, and nothing is
written. Every case runs in this one process (the commands' main functions, SystemExit caught)."""

import os

import pytest

from hf_ppmoe_cli import main


@pytest.fixture
def places(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "file.txt").write_text("a text\n")
    return tmp_path


def _listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _cases(t):
    model, file, folder, missing = str(t / "model"), str(t / "file.txt"), str(t / "model"), str(t / "nope" / "x")
    under_file = str(t / "file.txt" / "out")
    out = str(t / "out")
    cases = []  # (argv, words the error line must hold)
    for command, extra in (("upcycle", []), ("merge", []), ("import", []), ("export", ["--to", "mixtral"])):
        cases += [
            ([command, missing, out, *extra], ["SRC", "no such folder"]),
            ([command, file, out, *extra], ["SRC", "is a file"]),
            ([command, model, file, *extra], ["OUT", "is a file"]),
            ([command, model, under_file, *extra], ["OUT", "is a file, not a folder"]),
        ]
    for command in ("upcycle", "merge"):
        cases += [
            ([command, model, out, "--sample_file", str(t / "prompts.txt")], ["--sample_file", "no such file"]),
            ([command, model, out, "--sample_file", folder], ["--sample_file", "is a folder"]),
        ]
    cases += [
        (["demo", "--output_dir", file], ["--output_dir", "is a file"]),
        (["demo", "--output_dir", under_file], ["--output_dir", "is a file, not a folder"]),
        (["train", "--output_dir", file], ["--output_dir", "is a file"]),
        (["train", "--output_dir", under_file], ["--output_dir", "is a file, not a folder"]),
        (["train", "--output_dir", out, "--data_cache_dir", file], ["--data_cache_dir", "is a file"]),
        (["train", "--output_dir", out, "--config_name", missing], ["--config_name", "no such file"]),
        (["train", "--output_dir", out, "--config_name", folder], ["--config_name", "is a folder"]),
        (["train", "--output_dir", out, "--train_file", missing], ["--train_file", "no such file"]),
        (["train", "--output_dir", out, "--train_file", str(t / "*.jsonl")], ["--train_file", "no file matches"]),
        (["train", "--output_dir", out, "--model_name_or_path", file], ["--model_name_or_path", "is a file"]),
        (["train", "--output_dir", out, "--model_name_or_path", "./nope"], ["--model_name_or_path ./nope: no such folder."]),
        (["train", "--output_dir", out, "--model_name_or_path", "a/b/c"], ["--model_name_or_path a/b/c: no such folder."]),
        # a path under an existing folder is local, not a Hub id (user/name): no Hub look-up
        (["train", "--output_dir", out, "--model_name_or_path", str(t / "x")], [f"{t / 'x'}: no such folder."]),
        (["upcycle", str(t / "model" / "typo"), out], ["SRC", "typo: no such folder."]),
        (["train", "--output_dir", out, "--tokenizer_name", file], ["--tokenizer_name", "is a file"]),
        (["train", "--output_dir", out, "--resume", file], ["--resume", "is a file"]),
        (["megatron", "to-megatron", missing, out], ["SRC", "no such folder"]),
        (["megatron", "to-megatron", model, file], ["OUT", "is a file"]),
        (["megatron", "to-hf", file, out, "--config", model], ["SRC", "is a file"]),
        (["megatron", "to-hf", model, under_file, "--config", model], ["OUT", "is a file, not a folder"]),
        (["megatron", "to-hf", model, out, "--config", missing], ["--config", "no such file or folder"]),
    ]
    return cases


def _refused(capsys, argv) -> str:
    try:
        code = main(argv)
    except SystemExit as exit:
        code = exit.code
    err = capsys.readouterr().err
    assert code == 2, (argv, err)
    assert len(err.splitlines()) == 1 and err.startswith(f"hf-ppmoe {argv[0]}") and ": error: " in err, (argv, err)
    return err


def test_every_path_argument_is_refused_in_one_line_before_any_work(places, capsys):
    before = _listing(places)
    for argv, words in _cases(places):
        line = _refused(capsys, argv)
        assert all(word in line for word in words), (argv, line)
        assert _listing(places) == before, argv  # nothing written (no output folder, no logs, no cache)


def test_an_output_in_a_folder_that_cannot_be_written_is_refused(places, capsys):
    locked = places / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # root writes anywhere: the path under a file above is its unwritable case
            pytest.skip("running as root: permissions do not stop writes (the output-under-a-file case covers it)")
        for argv in (["upcycle", str(places / "model"), str(locked / "out")], ["demo", "--output_dir", str(locked / "d")],
                     ["train", "--output_dir", str(locked / "run")]):
            assert "is not writable" in _refused(capsys, argv)
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o700)


def test_hub_ids_and_new_nested_outputs_pass_the_check():
    from hf_ppmoe.utils.paths import path_problem

    assert path_problem("gpt2", "model", "SRC") is None
    assert path_problem("Qwen/Qwen3-0.6B", "model", "SRC") is None
    assert path_problem("a/b/c", "model", "SRC") is not None  # neither a folder nor a Hub id
    assert path_problem("/tmp/new/nested/out", "output_folder", "OUT") is None
    assert path_problem("/dev/null", "output_folder", "OUT") is not None
