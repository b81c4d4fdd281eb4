"""Reading HLO text in the tests: what a compiled (or lowered) program sends.

One reader for the tests that check the compiled program rather than what
the code meant to send. ``program(...)`` parses HLO text into its
computations; from there:

- ``collectives(...)``: every instruction that communicates (all-reduce,
  all-gather, all-to-all, ... and jaxcomm's FFI collectives), each with the
  arrays of its result: element type, shape, bytes;
- ``custom_calls(...)``: the custom calls, by target;
- ``count(...)``: instructions by opcode;
- ``conditionals(...)``: each conditional with its branches, to ask what
  runs in which.

Each can stay out of conditional branches (``branches=False``): what every
run of the program does. The attribute splitting is the library's own
(``jaxcomm.distributed.hlo``), which reads the HLO before optimisation for
``collective_sequence``; this reads the compiled text too, whose computation
headers list parameters and whose collectives may be asynchronous
(``-start``/``-done`` pairs, read as one collective with the ``-done``'s
result).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator

import jax

from jaxcomm.distributed.hlo import _COLLECTIVE_OPCODES, _attributes, _explicit_groups

# jaxcomm's FFI custom calls that exchange data between devices; the others
# (jaxcomm_pool, jaxcomm_after, jaxcomm_chunk_l1, jaxcomm_chunk_residual)
# copy, wait or compute on one device.
COMMUNICATING_TARGETS = frozenset(
    {
        "jaxcomm_allreduce",
        "jaxcomm_allreduce_parts",
        "jaxcomm_allreduce_start",
        "jaxcomm_allreduce_done",
        "jaxcomm_reduce_scatter",
        "jaxcomm_all_gather",
    }
)

_HEADER = re.compile(r"(?P<entry>ENTRY\s+)?%?(?P<name>[^\s(]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*")
_INSTRUCTION = re.compile(
    r"\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+) = (?P<type>\(.*?\)|\S+) (?P<opcode>[a-z][a-z0-9-]*)\("
)
_ARRAY = re.compile(r"\b(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[0-9,]*)\]")
_BITS = re.compile(r"[a-z]+?(?P<bits>\d+)")
# Attributes that name the computations an instruction runs, other than a
# conditional's branches.
_CALLS = ("to_apply", "body", "condition", "calls", "called_computations")
_BRANCHES = ("branch_computations", "true_computation", "false_computation")


@dataclasses.dataclass(frozen=True)
class Array:
    """One array of an instruction's result: ``u8[8,514]`` is ("u8", (8, 514))."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    @property
    def bytes(self) -> float:
        """Bytes at the element type's width (s4 and u4: half a byte each)."""
        if self.dtype == "pred":
            return self.elements
        bits = _BITS.match(self.dtype)
        if bits is None:
            raise ValueError(f"no width for {self.dtype}")
        return self.elements * int(bits["bits"]) / 8


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    opcode: str
    type: str  # the result type as printed, layouts included
    operands: tuple[str, ...]  # names
    attributes: dict[str, str]

    @property
    def arrays(self) -> list[Array]:
        """The arrays of the result, in order (one, or a tuple's)."""
        return [
            Array(m["dtype"], tuple(int(d) for d in m["dims"].split(",") if d))
            for m in _ARRAY.finditer(self.type)
        ]

    @property
    def dtypes(self) -> set[str]:
        return {a.dtype for a in self.arrays}

    @property
    def elements(self) -> int:
        return sum(a.elements for a in self.arrays)

    @property
    def bytes(self) -> float:
        return sum(a.bytes for a in self.arrays)

    @property
    def target(self) -> str | None:
        """A custom call's target, else None."""
        if self.opcode != "custom-call":
            return None
        return self.attributes.get("custom_call_target", "").strip('"')

    @property
    def collective(self) -> str | None:
        """What it exchanges as: the collective's opcode ("all-gather", also
        for an asynchronous all-gather's ``-done``), a communicating jaxcomm
        target, or None for an instruction that communicates nothing."""
        if self.target in COMMUNICATING_TARGETS:
            return self.target
        return self.opcode if self.opcode in _COLLECTIVE_OPCODES else None

    def _names(self, keys) -> list[str]:
        names = []
        for key in keys:
            names += re.findall(r"[^\s{},%]+", self.attributes.get(key, ""))
        return names

    @property
    def calls(self) -> list[str]:
        """The computations it runs, other than a conditional's branches."""
        return self._names(_CALLS)

    @property
    def branches(self) -> list[str]:
        """A conditional's branches, in order (index 0 is ``lax.cond``'s false branch)."""
        return self._names(_BRANCHES)


@dataclasses.dataclass(frozen=True)
class Program:
    """An HLO module: its instructions by computation, and the entry's name."""

    computations: dict[str, list[Instruction]]
    entry: str

    def walk(self, name: str | None = None, *, branches: bool = True) -> Iterator[Instruction]:
        """The instructions of computation ``name`` (the entry by default) and
        of what it calls, each where it is called; a conditional's branches
        only with ``branches``."""
        for instruction in self.computations[name or self.entry]:
            yield instruction
            called = instruction.calls + (instruction.branches if branches else [])
            for callee in called:
                yield from self.walk(callee, branches=branches)


def program(hlo: str | jax.stages.Lowered | jax.stages.Compiled | Program) -> Program:
    """Parses HLO text: a compiled program's ``as_text()``, a lowering's
    ``as_text(dialect="hlo")``, or the object itself (a ``Lowered`` is read
    before optimisation, a ``Compiled`` after)."""
    if isinstance(hlo, Program):
        return hlo
    if isinstance(hlo, jax.stages.Lowered):
        hlo = hlo.as_text(dialect="hlo")
    elif not isinstance(hlo, str):
        hlo = hlo.as_text()
    computations: dict[str, list[Instruction]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        if current is None:
            header = _HEADER.fullmatch(line)
            if header and not line.startswith("HloModule"):
                current = computations.setdefault(header["name"], [])
                entry = header["name"] if header["entry"] else entry
        elif line.strip() == "}":
            current = None
        elif m := _INSTRUCTION.match(line):
            operands, attributes = _split_operands(line, m.end())
            current.append(Instruction(m["name"], m["opcode"], m["type"], operands, attributes))
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text")
    return _asynchronous_as_one(Program(computations, entry))


def _split_operands(line: str, start: int) -> tuple[tuple[str, ...], dict[str, str]]:
    """The operands' names (``%x`` or ``f32[2]{0} %x``: the last word of
    each) and the attributes after the operands' closing parenthesis."""
    depth = 1
    for end in range(start, len(line)):
        depth += {"(": 1, ")": -1}.get(line[end], 0)
        if depth == 0:
            break
    else:
        raise ValueError(f"unbalanced operands: {line}")
    operands, bracketed = line[start:end], re.compile(r"\([^()]*\)|\[[^][]*\]|\{[^{}]*\}")
    while bracketed.search(operands):  # types, layouts: whatever holds commas
        operands = bracketed.sub("", operands)
    names = tuple(piece.split()[-1].lstrip("%") for piece in operands.split(",") if piece.strip())
    return names, _attributes(line[end + 1 :].lstrip(", "))


def _asynchronous_as_one(hlo: Program) -> Program:
    """An ``X-start``/``X-done`` pair as one ``X`` with the start's
    attributes and the done's result (the start's is a tuple holding its
    operands too)."""
    starts = {
        i.name: i
        for instructions in hlo.computations.values()
        for i in instructions
        if i.opcode.removesuffix("-start") in _COLLECTIVE_OPCODES - {i.opcode}
    }
    if not starts:
        return hlo
    computations = {}
    for name, instructions in hlo.computations.items():
        kept = []
        for i in instructions:
            opcode = i.opcode.removesuffix("-done")
            if i.name in starts:
                continue
            if opcode != i.opcode and opcode in _COLLECTIVE_OPCODES:
                start = starts[i.operands[0]]
                i = Instruction(i.name, opcode, i.type, start.operands, start.attributes)
            kept.append(i)
        computations[name] = kept
    return Program(computations, hlo.entry)


def compiled(f, *args) -> Program:
    """The program that ``jax.jit``-ed ``f`` compiles to for ``args``."""
    return program(f.lower(*args).compile())


def collectives(hlo, *, branches: bool = True) -> list[Instruction]:
    """The instructions that communicate, in the order the text lists them
    (a called computation's where it is called)."""
    return [i for i in program(hlo).walk(branches=branches) if i.collective]


def custom_calls(hlo, target: str | None = None, *, branches: bool = True) -> list[Instruction]:
    """The custom calls (to ``target`` only, if given)."""
    return [
        i
        for i in program(hlo).walk(branches=branches)
        if i.opcode == "custom-call" and target in (None, i.target)
    ]


def replica_groups(instruction: Instruction) -> str:
    """A collective's replica groups as XLA's explicit list, ``{{0,4},{1,5}}``,
    whichever form (list, iota, mesh axes) this XLA printed them in."""
    return _explicit_groups(instruction.attributes.get("replica_groups", ""))


def count(hlo, opcode: str, *, branches: bool = True) -> int:
    """How many instructions of ``opcode`` there are."""
    return sum(i.opcode == opcode for i in program(hlo).walk(branches=branches))


def conditionals(hlo) -> list[Instruction]:
    """The conditionals, each once, in whichever computation they are."""
    return [
        i
        for instructions in program(hlo).computations.values()
        for i in instructions
        if i.opcode == "conditional"
    ]
