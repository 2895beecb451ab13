"""Every code block in README.md works: python blocks run, bash commands parse.

Python blocks carry a `<!-- readme-test: world 1, 2 -->` marker naming the world
sizes to run them at: world 1 in this process, larger worlds in the harness (as
`torchrun` would, with the default process group already set up). Bash blocks are
checked without running them: shell syntax, the files they name, and every
`torchrun`/`pip` command's arguments through the real argument parsers.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import NamedTuple

import pytest

from harness import run_world

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
MARKER = re.compile(r"<!-- readme-test: world ([\d, ]+) -->")


class Block(NamedTuple):
    lang: str
    code: str
    line: int  # 1-based line of the opening fence
    worlds: tuple  # world sizes from the marker line just above, () if none


def readme_blocks() -> list:
    lines = README.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = re.fullmatch(r"```(\w*)", lines[i])
        if not fence:
            i += 1
            continue
        end = lines.index("```", i + 1)
        marker = MARKER.fullmatch(lines[i - 1]) if i else None
        worlds = tuple(int(w) for w in marker.group(1).split(",")) if marker else ()
        blocks.append(Block(fence.group(1), "\n".join(lines[i + 1:end]) + "\n", i + 1, worlds))
        i = end + 1
    return blocks


BLOCKS = readme_blocks()
PYTHON = [b for b in BLOCKS if b.lang == "python"]
BASH = [b for b in BLOCKS if b.lang == "bash"]
RUNS = [(b, w) for b in PYTHON for w in b.worlds]


def test_readme_has_the_blocks_it_documents():
    assert len(PYTHON) >= 2 and len(BASH) >= 4
    assert {b.lang for b in BLOCKS} <= {"python", "bash"}, "a block with no runnable language"
    unmarked = [b.line for b in PYTHON if not b.worlds]
    assert not unmarked, f"python blocks at lines {unmarked} have no readme-test marker"


def _exec_block(code: str) -> None:
    exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})


@pytest.mark.parametrize("block, world", RUNS, ids=[f"line{b.line}-world{w}" for b, w in RUNS])
def test_python_block_runs(block, world, monkeypatch, capsys):
    if world == 1:
        monkeypatch.delenv("RANK", raising=False)
        _exec_block(block.code)
        assert capsys.readouterr().out.strip(), "the block printed nothing"
    else:
        run_world(world, _exec_block, block.code, timeout=120)


def _commands(block: Block) -> list:
    """The block's commands: continuation lines joined, split on &&, tokenised."""
    text = block.code.replace("\\\n", " ")
    return [shlex.split(part) for line in text.splitlines() if line.strip()
            for part in line.split("&&")]


def _load_train_module():
    spec = importlib.util.spec_from_file_location("train_example_readme",
                                                  REPO / "examples" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_torchrun(argv: list) -> None:
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(argv)
    script = args.training_script
    if args.module:
        assert script == "torchtitan.train", f"unknown module {script}"
        from torchtitan.config import ConfigManager

        ConfigManager().parse_args(args.training_script_args)
    else:
        assert (REPO / script).is_file(), f"{script} does not exist"
        _load_train_module().parse_args(args.training_script_args)


def _check_pip(argv: list) -> None:
    assert argv[:4] == ["python", "-m", "pip", "install"], argv
    assert (REPO / argv[argv.index("-c") + 1]).is_file()
    target = argv[argv.index("-e") + 1]
    extras = re.fullmatch(r"\.\[([\w,]+)\]", target)
    assert extras, f"pip installs {target!r}, not the checkout with extras"
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = declared["optional-dependencies"]
    for extra in extras.group(1).split(","):
        assert extra in declared, f"extra {extra!r} is not in pyproject.toml"


def _check_example(argv: list) -> None:
    """`python examples/NAME.py ARGS`: the file exists and its parse_args takes ARGS."""
    path = REPO / argv[1]
    assert path.is_file(), f"{argv[1]} does not exist"
    spec = importlib.util.spec_from_file_location(f"readme_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.parse_args(argv[2:])


@pytest.mark.parametrize("block", BASH, ids=[f"line{b.line}" for b in BASH])
def test_bash_block_parses_and_names_real_things(block):
    syntax = subprocess.run(["bash", "-n"], input=block.code, text=True, capture_output=True)
    assert syntax.returncode == 0, syntax.stderr
    for argv in _commands(block):
        if argv[0] == "torchrun":
            _check_torchrun(argv[1:])
        elif argv[:3] == ["python", "-m", "pip"]:
            _check_pip(argv)
        elif argv[:3] == ["python", "-m", "pytest"]:
            assert (REPO / "tests").is_dir()
        elif argv[0] == "python" and argv[1].startswith("examples/"):
            _check_example(argv)
        else:
            raise AssertionError(f"README line {block.line}: no check for command {argv}")


def test_ci_runs_the_readme_test_command_and_it_installs_what_tests_import():
    ci = subprocess.run(["awk", "/<!-- test-command -->/{getline; getline; print; exit}",
                         str(README)], text=True, capture_output=True, check=True).stdout.strip()
    assert ci.startswith("python -m pip install ") and ci.endswith("python -m pytest -q"), ci
    extras = re.search(r'-e "\.\[([\w,]+)\]"', ci).group(1).split(",")
    assert {"dev", "torchtitan", "plots"} <= set(extras)
    main = README.read_text().split("<!-- main-command -->\n```bash\n")[1].split("\n")[0]
    assert main == "torchrun --standalone --nproc-per-node 2 examples/train.py"


def test_local_links_and_named_files_exist():
    text = README.read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not re.match(r"\w+://", link)]
    assert local, "no local links found"
    named = re.findall(r"`((?:examples|data|benchmarks|flexshard|tests)/[\w./-]+)`", text)
    assert named, "no file of the repository named in backticks"
    missing = [path for path in local + named if not (REPO / path).exists()]
    assert not missing, f"README names missing files: {missing}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
