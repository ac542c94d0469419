"""README.md's Python blocks run as written, each in a new process from a folder of its own.

A block runs as one CPU process, unless the line right before its opening fence is a comment
`<!-- test: OPTIONS -->` with options among:
- `ranks=N`: under torchrun, N processes on this machine (the block creates its process group itself);
- `needs=cuda`: one CUDA device per rank; `needs=MODULE`: an importable module (say, transformers);
  several, comma-separated: the block is skipped where one is missing;
- `skip: REASON`: not run (a block that needs what no test machine has); the reason is the skip's.
TRITON_INTERPRET is left out of a block's environment, as a user's shell would have it.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
_BLOCK = re.compile(r"^(?:<!-- test: (?P<options>.*?) -->\n)?```python\n(?P<code>.*?)^```$", re.M | re.S)
_OPTION = re.compile(r"^(ranks=[1-9][0-9]*|needs=[\w.]+(,[\w.]+)*)$")


@dataclass(frozen=True)
class Block:
    """One ```python block of a markdown file: its code, the line its fence opens on, and its options."""

    code: str
    line: int
    ranks: int = 1
    needs: tuple[str, ...] = ()
    skip: str | None = None


def parse_blocks(text: str) -> list[Block]:
    """Every ```python block of `text`; ValueError for a `test:` comment it cannot read."""
    blocks = []
    for m in _BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("code"))
        options = (m.group("options") or "").strip()
        if options.startswith("skip:"):
            reason = options[len("skip:"):].strip()
            if not reason:
                raise ValueError(f"line {line}: `skip:` needs a reason")
            blocks.append(Block(m.group("code"), line, skip=reason))
            continue
        ranks, needs = 1, ()
        for option in options.split():
            if not _OPTION.match(option):
                raise ValueError(f"line {line}: unknown test option {option!r} (ranks=N, needs=a,b, skip: REASON)")
            key, value = option.split("=", 1)
            if key == "ranks":
                ranks = int(value)
            else:
                needs = tuple(value.split(","))
        blocks.append(Block(m.group("code"), line, ranks, needs))
    return blocks


def _missing(block: Block) -> str | None:
    """Why `block` cannot run here, or None."""
    for need in block.needs:
        if need == "cuda":
            found = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if found < block.ranks:
                return f"needs {block.ranks} CUDA device(s), found {found}"
        elif importlib.util.find_spec(need) is None:
            return f"needs {need}"
    return None


def _readme_blocks() -> list[Block]:
    with open(README) as f:
        return parse_blocks(f.read())


def test_parse_blocks_reads_the_options():
    text = ("intro\n```python\na = 1\n```\n<!-- test: ranks=2 needs=cuda,numpy -->\n```python\nb = 2\n```\n"
            "```bash\nls\n```\n<!-- test: skip: no model here -->\n```python\nc\n```\n")
    assert parse_blocks(text) == [Block("a = 1\n", 2), Block("b = 2\n", 6, 2, ("cuda", "numpy")),
                                  Block("c\n", 13, skip="no model here")]
    for bad in ("ranks=0", "rank=2", "needs=", "skip:"):
        with pytest.raises(ValueError):
            parse_blocks(f"<!-- test: {bad} -->\n```python\nx\n```\n")


def test_readme_has_single_and_multi_rank_blocks():
    """The README shows both: a block for one process and one for several ranks on the CPU (gloo)."""
    blocks = _readme_blocks()
    assert any(b.ranks == 1 and not b.needs and b.skip is None for b in blocks)
    assert any(b.ranks > 1 and not b.needs and b.skip is None for b in blocks)


@pytest.mark.parametrize("block", _readme_blocks(), ids=lambda b: f"line{b.line}")
def test_readme_block_runs(block, tmp_path):
    if block.skip is not None:
        pytest.skip(block.skip)
    missing = _missing(block)
    if missing is not None:
        pytest.skip(missing)
    script = tmp_path / "block.py"
    script.write_text(block.code)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if block.ranks == 1:
        cmd = [sys.executable, str(script)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={block.ranks}",
               str(script)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert r.returncode == 0, f"README.md line {block.line}:\n{r.stdout}\n{r.stderr}"
