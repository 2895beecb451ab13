"""Every code block in README.md and docs/*.md works: python blocks run, bash
commands parse, and every local link and file named exists.

Python blocks carry a `<!-- readme-test: world 1, 2 -->` marker naming the world
sizes to run them at. Each runs as a user runs it: the block alone in a file, in a
fresh process with nothing set up beforehand, as `python block.py` at world 1 and
under `torchrun --nproc-per-node N` at world N (tests/doc_scripts.py: one launch per
world size, one forked process per block and rank). Bash blocks are checked without
running them: shell syntax, the files they name, and every `torchrun`/`pip`
command's arguments through the real argument parsers.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "RESULTS.md"]
MARKER = re.compile(r"<!-- readme-test: world ([\d, ]+) -->")


class Block(NamedTuple):
    lang: str
    code: str
    line: int  # 1-based line of the opening fence
    worlds: tuple  # world sizes from the marker line just above, () if none
    doc: str = "README.md"  # the page, relative to the repository

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def readme_blocks(page: Path = README) -> list:
    doc = page.relative_to(REPO).as_posix()
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = re.fullmatch(r"```(\w*)", lines[i])
        if not fence:
            i += 1
            continue
        end = lines.index("```", i + 1)
        marker = MARKER.fullmatch(lines[i - 1]) if i else None
        worlds = tuple(int(w) for w in marker.group(1).split(",")) if marker else ()
        blocks.append(Block(fence.group(1), "\n".join(lines[i + 1:end]) + "\n", i + 1, worlds,
                            doc))
        i = end + 1
    return blocks


BLOCKS = [b for page in DOCS for b in readme_blocks(page)]
PYTHON = [b for b in BLOCKS if b.lang == "python"]
BASH = [b for b in BLOCKS if b.lang == "bash"]
RUNS = [(b, w) for b in PYTHON for w in b.worlds]


def test_the_pages_have_the_blocks_they_document():
    readme = [b for b in BLOCKS if b.doc == "README.md"]
    assert sum(b.lang == "python" for b in readme) >= 2 and sum(b.lang == "bash" for b in readme) >= 2
    assert len(BASH) >= 6 and len(PYTHON) >= 10
    # text blocks show output (an error message): nothing to run
    assert {b.lang for b in BLOCKS} <= {"python", "bash", "text"}, "a block with no language"
    unmarked = [b.where for b in PYTHON if not b.worlds]
    assert not unmarked, f"python blocks at {unmarked} have no readme-test marker"


LAUNCH_TIMEOUT_S = 900


def _script_name(block: Block) -> str:
    return re.sub(r"\W", "_", block.where) + ".py"


def _launch(world: int, folder: Path, blocks: list) -> subprocess.Popen:
    """Start `blocks` as scripts at `world` ranks; results land in `folder`."""
    folder.mkdir(parents=True)
    scripts = []
    for block in blocks:
        (folder / _script_name(block)).write_text(block.code)
        scripts.append(str(folder / _script_name(block)))
    runner = [str(REPO / "tests" / "doc_scripts.py"), str(folder), *scripts]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    if world == 1:
        argv = [sys.executable, *runner]
    else:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={world}", *runner]
    return subprocess.Popen(argv, cwd=folder, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def block_runs(request, tmp_path_factory) -> dict:
    """(block, world) -> (exit status, output) per rank, for the blocks this session
    selected: every world size launched at once, each running its blocks in turn."""
    chosen = [item.callspec.params for item in request.session.items
              if getattr(item, "originalname", None) == "test_python_block_runs"]
    by_world: dict = {}
    for params in chosen:
        by_world.setdefault(params["world"], []).append(params["block"])
    root = tmp_path_factory.mktemp("doc_blocks")
    launches = {w: _launch(w, root / f"world{w}", blocks) for w, blocks in by_world.items()}
    logs = {}
    for world, proc in launches.items():
        try:
            logs[world] = proc.communicate(timeout=LAUNCH_TIMEOUT_S)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            logs[world] = proc.communicate()[0] + "\n(the launch timed out)"
    results = {}
    for world, blocks in by_world.items():
        for block in blocks:
            base = root / f"world{world}" / _script_name(block)
            ranks = []
            for rank in range(world):
                rc, out = Path(f"{base}.{rank}.rc"), Path(f"{base}.{rank}.out")
                ranks.append((rc.read_text() if rc.exists() else "not run",
                              out.read_text() if out.exists() else ""))
            results[block.where, world] = (ranks, logs[world])
    return results


@pytest.mark.parametrize("block, world", RUNS, ids=[f"{b.doc}:{b.line}-world{w}" for b, w in RUNS])
def test_python_block_runs(block, world, block_runs):
    ranks, launch_log = block_runs[block.where, world]
    failed = [(r, rc, out) for r, (rc, out) in enumerate(ranks) if rc != "0"]
    assert not failed, "\n".join(
        [f"{block.where} at world {world}: rank {r} exited {rc}\n{out[-3000:]}"
         for r, rc, out in failed] + [f"launch output:\n{launch_log[-2000:]}"])
    assert ranks[0][1].strip(), f"{block.where} at world {world}: the block printed nothing"


def _commands(block: Block) -> list:
    """The block's commands: continuation lines joined, split on &&, tokenised,
    comments and leading VAR=value assignments dropped."""
    text = block.code.replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        for part in line.split("&&"):
            argv = shlex.split(part, comments=True)
            while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
                argv = argv[1:]
            if argv:
                out.append(argv)
    return out


# Parses every benchmark command of the pages in one process (importing torch once, not
# once per command): each module runs as __main__ until its argparse parser has parsed
# the command's args, then stops. argv[1] is a JSON list of [module, args]; prints a JSON
# object of the commands that failed, with why.
_PARSE_ALL = """
import argparse, contextlib, io, json, runpy, sys

class Parsed(Exception):
    pass

def parse_then_stop(self, args=None, namespace=None, _parse=argparse.ArgumentParser.parse_args):
    _parse(self, args, namespace)  # exits 2 on args it refuses
    raise Parsed

argparse.ArgumentParser.parse_args = parse_then_stop
failed = {}
for module, args in json.loads(sys.argv[1]):
    sys.argv, err = [module, *args], io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        why = "it ran to the end without parsing its args"
    except Parsed:
        continue
    except SystemExit as e:
        why = f"exit {e.code}"
    except Exception as e:
        why = repr(e)
    failed[" ".join([module, *args])] = f"{why}: {err.getvalue()[-500:]}"
print(json.dumps(failed))
"""


def _benchmark_call(argv: list):
    """(module, args) when `argv` runs a benchmark module, directly or by torchrun."""
    if argv[:2] == ["python", "-m"] and argv[2].startswith("benchmarks."):
        return argv[2], tuple(argv[3:])
    if argv[0] == "torchrun":
        from torch.distributed.run import get_args_parser

        args = get_args_parser().parse_args(argv[1:])
        if args.module and args.training_script.startswith("benchmarks."):
            return args.training_script, tuple(args.training_script_args)
    return None


@functools.lru_cache(maxsize=None)
def _benchmark_parse_failures() -> dict:
    calls = sorted({c for b in BASH for argv in _commands(b) if (c := _benchmark_call(argv))})
    done = subprocess.run([sys.executable, "-c", _PARSE_ALL, json.dumps(calls)], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check_benchmark(module: str, argv: list) -> None:
    """`python -m benchmarks.NAME ARGS`: its own parser takes ARGS."""
    assert (REPO / (module.replace(".", "/") + ".py")).is_file(), f"{module} does not exist"
    failure = _benchmark_parse_failures().get(" ".join([module, *argv]))
    assert failure is None, f"{module} {argv}: {failure}"


def _check_torchrun(argv: list) -> None:
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(argv)
    script = args.training_script
    if args.module and script.startswith("benchmarks."):
        _check_benchmark(script, args.training_script_args)
    elif args.module:
        assert script == "torchtitan.train", f"unknown module {script}"
        from torchtitan.config import ConfigManager

        ConfigManager().parse_args(args.training_script_args)
    else:  # what torchrun sets for its processes (an example may check it)
        with mock.patch.dict(os.environ, {"WORLD_SIZE": str(args.nproc_per_node)}):
            _check_example(["python", script, *args.training_script_args])


def _load_example(path: Path):
    assert path.is_file(), f"{path.relative_to(REPO)} does not exist"
    spec = importlib.util.spec_from_file_location(f"readme_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _check_pip(argv: list) -> None:
    assert argv[:4] == ["python", "-m", "pip", "install"], argv
    if "--no-deps" in argv:  # the PhysicsNeMo lock, after the set-up's
        assert (REPO / argv[argv.index("-r") + 1]).is_file()
        return
    assert (REPO / argv[argv.index("-c") + 1]).is_file()
    target = argv[argv.index("-e") + 1]
    extras = re.fullmatch(r"\.\[([\w,]+)\]", target)
    assert extras, f"pip installs {target!r}, not the checkout with extras"
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = declared["optional-dependencies"]
    for extra in extras.group(1).split(","):
        assert extra in declared, f"extra {extra!r} is not in pyproject.toml"


def _check_example(argv: list) -> None:
    """`python examples/NAME.py ARGS` (or under torchrun): the file exists and its
    parse_args takes ARGS (one without parse_args is given none)."""
    module = _load_example(REPO / argv[1])
    if hasattr(module, "parse_args"):
        module.parse_args(argv[2:])
    else:
        assert not argv[2:], f"{argv[1]} takes no arguments, the page passes {argv[2:]}"


@pytest.mark.parametrize("block", BASH, ids=[b.where for b in BASH])
def test_bash_block_parses_and_names_real_things(block):
    syntax = subprocess.run(["bash", "-n"], input=block.code, text=True, capture_output=True)
    assert syntax.returncode == 0, syntax.stderr
    for argv in _commands(block):
        if argv[0] == "torchrun":
            _check_torchrun(argv[1:])
        elif argv[:3] == ["python", "-m", "pip"]:
            _check_pip(argv)
        elif argv[:2] == ["python", "-m"] and argv[2].startswith("benchmarks."):
            _check_benchmark(argv[2], argv[3:])
        elif argv[:3] == ["python", "-m", "pytest"]:
            assert (REPO / "tests").is_dir()
        elif argv[0] == "python" and argv[1].startswith("examples/"):
            _check_example(argv)
        elif argv[0] == "bash" and argv[1].startswith("benchmarks/"):
            script = REPO / argv[1]
            assert script.is_file(), f"{argv[1]} does not exist"
            parsed = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
            assert parsed.returncode == 0, parsed.stderr
        else:
            raise AssertionError(f"{block.where}: no check for command {argv}")


def test_ci_runs_the_readme_test_command_and_it_installs_what_tests_import():
    ci = subprocess.run(["awk", "/<!-- test-command -->/{getline; getline; print; exit}",
                         str(README)], text=True, capture_output=True, check=True).stdout.strip()
    assert ci.startswith("python -m pip install "), ci
    assert ci.endswith("python -m pytest -q -n 2 --dist loadfile"), ci
    extras = re.search(r'-e "\.\[([\w,]+)\]"', ci).group(1).split(",")
    assert {"dev", "torchtitan", "plots"} <= set(extras)
    main = README.read_text().split("<!-- main-command -->\n```bash\n")[1].split("\n")[0]
    assert main == "torchrun --standalone --nproc-per-node 2 examples/train.py"


@pytest.mark.parametrize("page", DOCS, ids=[p.name for p in DOCS])
def test_local_links_and_named_files_exist(page):
    text = page.read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    local = [page.parent / link for link in links if not re.match(r"\w+://", link)]
    named = [REPO / p for p in
             re.findall(r"`((?:examples|data|benchmarks|flexshard|tests)/[\w./-]+)`", text)]
    missing = [str(path.relative_to(REPO)) for path in local + named if not path.exists()]
    assert not missing, f"{page.name} names missing files: {missing}"


LOWERCASE_NAMES = {"flexshard", "flexshard's", "flex_shard", "dynamo", "torchtitan", "torchtitan's",
                   "torch", "torchao", "torchrun"}  # names a sentence may start with as spelled


@pytest.mark.parametrize("page", DOCS, ids=[p.name for p in DOCS])
def test_paragraphs_start_as_sentences(page):
    """A paragraph of prose starts with a capital, a `code` span or a name spelled in
    lowercase, not mid-sentence (a fragment left by an edit)."""
    prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    starts = [p.split(None, 1)[0] for p in re.split(r"\n\s*\n", prose) if p.strip()]
    fragments = [w for w in starts if w[0].islower() and w.rstrip(":,") not in LOWERCASE_NAMES]
    assert not fragments, f"{page.name}: paragraphs start mid-sentence: {fragments}"


def test_the_readme_links_every_page_of_docs():
    linked = set(re.findall(r"\(docs/([\w-]+\.md)\)", README.read_text()))
    assert linked == {p.name for p in DOCS if p.parent.name == "docs"}, "a docs/ page the map misses"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
