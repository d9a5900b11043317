# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""The converter never loses data: it refuses an output that would replace or change the source, gives its folders
the permissions `save_pretrained` gives, cleans what a killed run left (and puts back an output a killed `--force`
run had moved aside), refuses a checkpoint that does not match its config before it builds or writes anything, and
ends every expected failure (a full disk included) in one line on stderr with exit status 2.

The CLI's contract is checked through the real CLI, `python -m modeling_dint.conversion`: a successful conversion in a
subprocess of its own, the expected failures each in a process forked from one that imported torch, transformers and
the converter once (`run_forked_cli`: a fresh interpreter spends seconds on those imports, twenty of them minutes).
"""

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from modeling_dint import DintConfig, DintForCausalLM
from modeling_dint.conversion import convert_checkpoint
from test_conversion import TINY, make_model


CLI = [sys.executable, "-m", "modeling_dint.conversion"]
PARALLEL_PROCESSES = 4


def save_llama(folder: Path, **overrides) -> Path:
    make_model(LlamaForCausalLM, LlamaConfig, **overrides).save_pretrained(folder)
    return folder


def tree_snapshot(root: Path) -> dict:
    """Every entry below `root` (hidden ones included): its kind, mode and content (a file's hash, a link's target)."""
    snapshot = {}
    for folder, folder_names, file_names in os.walk(root):
        for name in folder_names + file_names:
            path = Path(folder) / name
            info = path.lstat()
            if path.is_symlink():
                content = os.readlink(path)
            elif path.is_file():
                content = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                content = None
            snapshot[str(path.relative_to(root))] = (stat.S_IFMT(info.st_mode), stat.S_IMODE(info.st_mode), content)
    return snapshot


# --------------------------------------------------------------------------------------------------------------------
# An output that is, contains or lies inside the source


@pytest.mark.parametrize(
    "layout,relation",
    [
        ("output-is-source", "is"),
        ("output-is-source-by-symlink", "is"),
        ("output-is-source-by-relative-path", "is"),
        ("output-contains-source", "contains"),
        ("output-inside-source", "lies inside"),
        ("output-inside-source-through-symlink", "lies inside"),
    ],
)
def test_output_that_is_contains_or_lies_inside_the_source_is_refused(tmp_path, monkeypatch, layout, relation):
    source = save_llama(tmp_path / "parent" / "src")
    (tmp_path / "parent" / "notes.txt").write_text("unrelated")
    monkeypatch.chdir(tmp_path / "parent")
    if layout == "output-is-source":
        output = source
    elif layout == "output-is-source-by-symlink":
        (tmp_path / "link").symlink_to(source)
        output = tmp_path / "link"
    elif layout == "output-is-source-by-relative-path":
        output = Path("src/../src")
    elif layout == "output-contains-source":
        output = tmp_path / "parent"
    elif layout == "output-inside-source":
        output = source / "out"
    else:  # a symlink next to the source that points into it
        (tmp_path / "link").symlink_to(source)
        output = tmp_path / "link" / "out"
    before = tree_snapshot(tmp_path)
    with pytest.raises(ValueError, match=f"{relation} the source checkpoint.*outside the source"):
        convert_checkpoint(source, output, force=True, progress=False)
    assert tree_snapshot(tmp_path) == before


# --------------------------------------------------------------------------------------------------------------------
# Permissions


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_converted_folder_gets_the_permissions_save_pretrained_gives(tmp_path, umask):
    source = save_llama(tmp_path / "source")
    previous_umask = os.umask(umask)
    try:
        DintForCausalLM(DintConfig(**TINY)).save_pretrained(tmp_path / "saved")
        convert_checkpoint(source, tmp_path / "converted", progress=False)
        convert_checkpoint(source, tmp_path / "converted", force=True, progress=False)  # the replacing path
    finally:
        os.umask(previous_umask)
    saved_mode = stat.S_IMODE((tmp_path / "saved").stat().st_mode)
    assert saved_mode == 0o777 & ~umask
    assert stat.S_IMODE((tmp_path / "converted").stat().st_mode) == saved_mode


# --------------------------------------------------------------------------------------------------------------------
# Killed and failed runs


def run_killed(source: Path, output: Path, kill_when: str, *extra_arguments: str) -> subprocess.CompletedProcess:
    """Runs the CLI in a subprocess that SIGKILLs itself at one point (no cleanup can run): after writing its first
    shard (`kill_when="shard-written"`), or when moving the new output into place (`"output-renamed"`)."""
    script = f"""
import os, signal, sys
from pathlib import Path
from modeling_dint.conversion import checkpoint
from modeling_dint.conversion.__main__ import main

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if {kill_when!r} == "shard-written":
    write_shard = checkpoint.ShardedSafetensorsWriter._flush
    def _flush(self):
        write_shard(self)
        die()
    checkpoint.ShardedSafetensorsWriter._flush = _flush
else:
    rename = os.rename
    def renaming(source, destination):
        if Path(destination).absolute() == Path({str(output)!r}).absolute():
            die()
        rename(source, destination)
    os.rename = renaming
sys.exit(main(sys.argv[1:]))
"""
    arguments = [str(source), str(output), "--quiet", *extra_arguments]
    completed = subprocess.run([sys.executable, "-c", script, *arguments], capture_output=True, text=True)
    assert completed.returncode == -9, completed.stderr
    return completed


def hidden_entries(folder: Path) -> set[str]:
    return {path.name for path in folder.iterdir() if path.name.startswith(".")}


def test_rerun_removes_what_a_killed_run_left_and_nothing_else(tmp_path):
    source = save_llama(tmp_path / "source")
    # Names that are not this converter's staging folders for `dint`: none of them may be touched.
    decoys = [
        ".dint.backup",  # the user's
        ".dint.tmp-abcd1234",  # another tool's temporary folder
        ".dint2.dint-convert-staging-999999-0123abcd",  # the staging folder of another output
        ".dint.dint-convert-staging-notapid-0123abcd",  # not the converter's exact pattern
    ]
    for name in decoys:
        (tmp_path / name).mkdir()
        (tmp_path / name / "data.txt").write_text(name)
    (tmp_path / ".dint.dint-convert-old-999999-0123abcd").write_text("a file, not a folder")
    decoys.append(".dint.dint-convert-old-999999-0123abcd")
    decoy_snapshot = {name: tree_snapshot(tmp_path / name) for name in decoys}

    run_killed(source, tmp_path / "dint", "shard-written", "--max-shard-size", "1KB")
    leftovers = hidden_entries(tmp_path) - set(decoys)
    assert len(leftovers) == 1 and not (tmp_path / "dint").exists()
    leftover = tmp_path / leftovers.pop()
    assert any(path.suffix == ".safetensors" for path in leftover.iterdir())  # killed in the middle of writing

    convert_checkpoint(source, tmp_path / "dint", progress=False)
    assert hidden_entries(tmp_path) == set(decoys)
    assert {name: tree_snapshot(tmp_path / name) for name in decoys} == decoy_snapshot
    DintForCausalLM.from_pretrained(tmp_path / "dint")


def test_rerun_puts_back_the_output_a_killed_force_run_had_moved_aside(tmp_path):
    source = save_llama(tmp_path / "source")
    (tmp_path / "dint").mkdir()
    (tmp_path / "dint" / "keep.txt").write_text("mine")

    run_killed(source, tmp_path / "dint", "output-renamed", "--force")
    assert not (tmp_path / "dint").exists()  # killed between moving the old output aside and the new one in
    assert len(hidden_entries(tmp_path)) == 2  # the old output, aside, and the complete new one

    with pytest.raises(FileExistsError, match="already exists"):  # no --force: the old output is back, untouched
        convert_checkpoint(source, tmp_path / "dint", progress=False)
    assert (tmp_path / "dint" / "keep.txt").read_text() == "mine"
    assert hidden_entries(tmp_path) == set()


@pytest.mark.parametrize("failing_rename", ["old-output-aside", "new-output-in"])
def test_failed_force_replacement_keeps_the_old_output_and_leaves_no_hidden_folder(tmp_path, monkeypatch,
                                                                                   failing_rename):
    source = save_llama(tmp_path / "source")
    (tmp_path / "dint").mkdir()
    (tmp_path / "dint" / "keep.txt").write_text("mine")
    rename, failed = os.rename, []

    def failing(source_path, destination):
        """Fails the first rename of the kind chosen (later ones, e.g. putting the old output back, succeed)."""
        output = (tmp_path / "dint").absolute()
        if failing_rename == "old-output-aside":
            chosen = Path(source_path).absolute() == output
        else:
            chosen = Path(destination).absolute() == output
        if chosen and not failed:
            failed.append(source_path)
            raise PermissionError(13, "Permission denied", str(source_path))
        rename(source_path, destination)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(PermissionError):
        convert_checkpoint(source, tmp_path / "dint", force=True, progress=False)
    monkeypatch.setattr(os, "rename", rename)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["dint", "source"]
    assert sorted(path.name for path in (tmp_path / "dint").iterdir()) == ["keep.txt"]


# --------------------------------------------------------------------------------------------------------------------
# The CLI: one line on stderr and exit status 2 for every expected failure


class UnpicklingPayload:
    """Anything but tensors and plain containers: `torch.load(weights_only=True)` refuses to unpickle it."""


def make_read_only(folder: Path) -> bool:
    """Makes `folder` unwritable, for root too (the immutable attribute); False where this machine cannot."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
    elif shutil.which("chattr") is not None:
        subprocess.run(["chattr", "+i", str(folder)], capture_output=True)
    try:
        (folder / "probe").mkdir()
    except OSError:
        return True
    (folder / "probe").rmdir()
    return False


def make_writable(folder: Path) -> None:
    if os.geteuid() == 0 and shutil.which("chattr"):
        subprocess.run(["chattr", "-i", str(folder)], capture_output=True)
    folder.chmod(0o755)


def cli_case(case: str, root: Path) -> tuple[list[str], str] | None:
    """Prepares folder `root` for one failure case; returns (the CLI arguments, a phrase the error must contain),
    or None where the case cannot be set up on this machine."""
    root.mkdir()
    source = root / "src"
    if case == "pickle-checkpoint":
        LlamaConfig(**TINY).save_pretrained(source)
        torch.save({"model.norm.weight": UnpicklingPayload()}, source / "pytorch_model.bin")
        return [str(source), str(root / "out")], "Weights only load failed"
    if case == "truncated-safetensors":
        save_llama(source)
        weights = (source / "model.safetensors").read_bytes()
        (source / "model.safetensors").write_bytes(weights[: len(weights) - 100])
        return [str(source), str(root / "out")], "not a complete safetensors file"
    if case == "output-under-a-file":
        save_llama(source)
        (root / "file.txt").write_text("a file")
        return [str(source), str(root / "file.txt" / "sub" / "out")], "Cannot write the output directory"
    if case == "read-only-output-folder":
        save_llama(source)
        (root / "read-only").mkdir()
        if not make_read_only(root / "read-only"):
            return None
        return [str(source), str(root / "read-only" / "out")], "Cannot write the output directory"
    if case == "invalid-config":
        DintForCausalLM(DintConfig(**TINY, integral="none")).save_pretrained(source)
        config = json.loads((source / "config.json").read_text())
        (source / "config.json").write_text(json.dumps({**config, "integral": "sofmax"}))
        return [str(source), str(root / "out")], "`integral` must be one of"
    if case == "missing-source":
        return [str(root / "no-such-model"), str(root / "out")], "does not exist"
    if case == "unsupported-architecture":
        source.mkdir()
        (source / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
        return [str(source), str(root / "out")], "Unsupported architecture"
    if case == "unpairable-heads":
        save_llama(source, num_attention_heads=3, num_key_value_heads=1)
        return [str(source), str(root / "out")], "Cannot pair the heads"
    if case == "existing-output":
        save_llama(source)
        (root / "out").mkdir()
        return [str(source), str(root / "out")], "already exists"
    if case in ("output-is-a-file", "output-is-a-file-with-force"):  # a file is never replaced, not even with --force
        save_llama(source)
        (root / "afile").write_text("mine")
        force = ["--force"] if case.endswith("with-force") else []
        return [str(source), str(root / "afile"), *force], "afile' is a file, not a folder: choose a folder path"
    if case == "output-is-source":
        save_llama(source)
        return [str(source), str(source), "--force"], "is the source checkpoint"
    if case == "output-contains-source":
        save_llama(source)
        return [str(source), str(root), "--force"], "contains the source checkpoint"
    if case == "output-inside-source":
        save_llama(source)
        return [str(source), str(source / "out")], "lies inside the source checkpoint"
    if case == "config-claims-a-million-layers":  # refused from the tensor names, before a model that size is built
        edit_config(save_llama(source), num_hidden_layers=10**6)
        return [str(source), str(root / "out")], "num_hidden_layers=1000000, but the checkpoint"
    if case == "config-hidden-size-not-the-weights":
        edit_config(save_llama(source), hidden_size=4096)
        return [str(source), str(root / "out")], "(vocab_size, hidden_size) = (96, 4096)"
    if case == "integer-tensor-in-a-float-weight":
        save_llama(source)
        weights = load_file(source / "model.safetensors")
        weights["model.layers.1.mlp.up_proj.weight"] = weights["model.layers.1.mlp.up_proj.weight"].to(torch.int8)
        save_file(weights, source / "model.safetensors", metadata={"format": "pt"})
        return [str(source), str(root / "out")], "{'model.layers.1.mlp.up_proj.weight': 'torch.int8'}"
    if case == "config-not-json":
        save_llama(source)
        (source / "config.json").write_text('{"model_type": "llama", ')
        return [str(source), str(root / "out")], f"Invalid {str(source / 'config.json')!r}: not valid JSON"
    if case == "config-not-an-object":
        save_llama(source)
        (source / "config.json").write_text("[1, 2]")
        return [str(source), str(root / "out")], f"Invalid {str(source / 'config.json')!r}: expected a JSON object"
    if case == "config-field-of-the-wrong-type":
        edit_config(save_llama(source), hidden_size="large")
        return [str(source), str(root / "out")], f"Invalid config {str(source / 'config.json')!r}: Field 'hidden_size'"
    raise AssertionError(case)


def edit_config(source: Path, **fields) -> None:
    config_file = source / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **fields}))


CLI_FAILURES = [
    "pickle-checkpoint",
    "truncated-safetensors",
    "output-under-a-file",
    "read-only-output-folder",
    "invalid-config",
    "missing-source",
    "unsupported-architecture",
    "unpairable-heads",
    "existing-output",
    "output-is-a-file",
    "output-is-a-file-with-force",
    "output-is-source",
    "output-contains-source",
    "output-inside-source",
    "config-claims-a-million-layers",
    "config-hidden-size-not-the-weights",
    "integer-tensor-in-a-float-weight",
    "config-not-json",
    "config-not-an-object",
    "config-field-of-the-wrong-type",
]


FORKED_CLI_SCRIPT = """
import json, os, runpy, signal, sys, traceback
import modeling_dint.conversion.convert  # what `python -m modeling_dint.conversion` imports, imported once

for name, (arguments, stdout_path, stderr_path) in json.load(sys.stdin).items():
    child = os.fork()
    if child == 0:  # `python -m modeling_dint.conversion ARGUMENTS` from here, its output in the two files
        signal.alarm(120)  # a case that hangs ends as killed by SIGALRM, not the whole module's run
        for descriptor, path in ((1, stdout_path), (2, stderr_path)):
            file = os.open(path, os.O_WRONLY | os.O_CREAT)
            os.dup2(file, descriptor)
            os.close(file)
        status = 0
        try:
            sys.argv = ["-m", *arguments]
            runpy.run_module("modeling_dint.conversion", run_name="__main__", alter_sys=True)
        except SystemExit as exit:  # as the interpreter ends on it
            if exit.code is None or isinstance(exit.code, int):
                status = exit.code or 0
            else:
                print(exit.code, file=sys.stderr)
                status = 1
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)  # (no interpreter shutdown: the converter registers no atexit handler and starts no thread)
    _, wait_status = os.waitpid(child, 0)
    print(json.dumps([name, os.waitstatus_to_exitcode(wait_status)]), flush=True)
"""


def run_forked_cli(
    cases: dict[str, list[str]], output_dir: Path, timeout: float = 300.0
) -> dict[str, subprocess.CompletedProcess]:
    """Runs `python -m modeling_dint.conversion` with each case's arguments in a process of its own, forked from one
    that imported the converter (and so torch and transformers) once; returns `{case: CompletedProcess}`. What a
    case prints is what its command prints after the imports."""
    files = {name: [arguments, str(output_dir / f"{name}.stdout"), str(output_dir / f"{name}.stderr")]
             for name, arguments in cases.items()}
    server = subprocess.run([sys.executable, "-c", FORKED_CLI_SCRIPT], input=json.dumps(files), capture_output=True,
                            text=True, timeout=timeout)
    assert server.returncode == 0, server.stderr[-3000:]
    statuses = dict(json.loads(line) for line in server.stdout.splitlines() if line.startswith("["))
    assert set(statuses) == set(cases), server.stdout[-3000:] + server.stderr[-3000:]
    results = {
        name: subprocess.CompletedProcess(CLI + arguments, statuses[name], Path(stdout).read_text(),
                                          Path(stderr).read_text())
        for name, (arguments, stdout, stderr) in files.items()
    }
    return results


def run_processes(commands: dict[str, list[str]], timeout: float = 180.0) -> dict[str, subprocess.CompletedProcess]:
    """Runs the commands, `PARALLEL_PROCESSES` at a time; returns their results by name. A command still running
    `timeout` seconds after it started is killed (its returncode is then negative)."""
    results, pending, running = {}, list(commands.items()), {}
    while pending or running:
        while pending and len(running) < PARALLEL_PROCESSES:
            name, command = pending.pop(0)
            running[name] = (command, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                        text=True), time.monotonic())
        name = next(iter(running))
        command, process, started = running.pop(name)
        try:
            stdout, stderr = process.communicate(timeout=max(started + timeout - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
            stderr += f"\n(killed: still running after {timeout:.0f} s)"
        results[name] = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    return results


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """Every CLI case of this module, run once: {case: (result, expected phrase, snapshots before and after)}; the
    failures' results hold what their commands print after the imports (`run_forked_cli`). Plus "import-only", a
    bare import of the converter in a fresh process (what this environment prints before any converter code)."""
    root = tmp_path_factory.mktemp("cli")
    cases = {case: cli_case(case, root / case) for case in CLI_FAILURES}
    success_source = save_llama(root / "success" / "src")
    failures = {case: arguments for case, (arguments, _) in ((c, v) for c, v in cases.items() if v)}
    commands = {"success": CLI + [str(success_source), str(root / "success" / "out")],
                "import-only": [sys.executable, "-c", "import modeling_dint.conversion.convert"]}
    snapshots_before = {case: tree_snapshot(root / case) for case in [*commands, *failures] if (root / case).is_dir()}
    (root / "outputs").mkdir()
    try:
        results = run_processes(commands)
        results.update(run_forked_cli(failures, root / "outputs"))
        runs = {}
        for case, result in results.items():
            after = tree_snapshot(root / case) if (root / case).is_dir() else None
            phrase = cases[case][1] if cases.get(case) else None
            runs[case] = (result, phrase, snapshots_before.get(case), after)
    finally:  # an immutable folder could not be removed with the temporary folders
        make_writable(root / "read-only-output-folder" / "read-only")
    return runs


@pytest.mark.parametrize("case", CLI_FAILURES)
def test_cli_expected_failure_is_one_line_on_stderr_and_status_2(cli_runs, case):
    if case not in cli_runs:
        pytest.skip(f"{case}: cannot make a folder unwritable on this machine")
    result, phrase, before, after = cli_runs[case]
    lines = result.stderr.splitlines()  # after the imports (`run_forked_cli`)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert len(lines) == 1, result.stderr
    assert lines[-1].startswith("dint-convert: error: ") and phrase in lines[-1], lines[-1]
    assert after == before  # nothing written, nothing removed


def test_cli_prints_no_empty_progress_bar(cli_runs):
    result = cli_runs["success"][0]
    assert result.returncode == 0, result.stderr
    assert "Converting tensors" in result.stderr  # the converter's own bar stays
    assert "Writing model shards" not in result.stderr


# --------------------------------------------------------------------------------------------------------------------
# A full disk


FULL_DISK_SCRIPT = """
import sys
from safetensors import SafetensorError, torch as safetensors_torch
from modeling_dint.conversion.__main__ import main

def serialize_file(*args, **kwargs):  # what safetensors raises when the disk fills while it writes
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

safetensors_torch.serialize_file = serialize_file
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(params=["small-filesystem", "injected-write-failure"])
def full_disk(request, tmp_path):
    """(a folder where the converted weights do not fit, the command that converts into it): a 1 MB tmpfs (where
    this machine lets the tests mount one) or a safetensors writer that fails as on a full disk."""
    folder = tmp_path / "disk"
    folder.mkdir()
    if request.param == "injected-write-failure":
        yield folder, [sys.executable, "-c", FULL_DISK_SCRIPT]
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(folder)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield folder, CLI
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_full_disk_is_one_line_on_stderr_status_2_and_leaves_nothing(tmp_path, full_disk, cli_runs):
    folder, command = full_disk
    # 8 MB of weights: the config and the remote-code files fit in the tmpfs, the weights do not
    source = save_llama(tmp_path / "source", hidden_size=256, intermediate_size=1024, head_dim=64)
    before = tree_snapshot(source)
    result = subprocess.run([*command, str(source), str(folder / "dint"), "--quiet"], capture_output=True, text=True,
                            timeout=300)
    environment_lines = cli_runs["import-only"][0].stderr.splitlines()  # e.g. warnings of optional packages
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert "Traceback" not in result.stderr and len(lines) == len(environment_lines) + 1, result.stderr
    assert lines[-1] == (f"dint-convert: error: Cannot write the output directory {str(folder / 'dint')!r}: No space "
                         "left on device. Nothing was written."), lines[-1]
    assert list(folder.iterdir()) == []  # the hidden staging folder is removed
    assert tree_snapshot(source) == before
