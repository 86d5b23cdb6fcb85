"""Seeded, reproducible workloads. The same seed always gives the same requests.

A workload is a list of sessions; a session is one or more turns sent one after another, each turn
resending the conversation so far (with the answers the server really gave). Single-turn workloads
have one-turn sessions.

- `random`: prompt and output lengths drawn from distributions;
- `shared-prefix`: G groups x U users; each group shares one long system prompt, each request adds a
  short unique question (the shape llm-d and the Gateway API inference extension use: many users behind
  a few long prompts), shuffled so groups interleave as real traffic does;
- `multi-turn`: conversations that grow turn by turn;
- `adapters`: single-turn requests, each to one of N LoRA adapters drawn from a Zipf distribution (a few
  adapters take most requests, a long tail the rest: the shape of many fine-tunes behind one base);
- `kv-pressure`: G groups (long system prompts) whose popularity is Zipf-skewed, and multi-turn sessions
  under them whose history grows turn by turn; sized so that the distinct prompt tokens outgrow a
  replica's KV cache (`kv_pressure_sizing` says by how much), so what a replica really still holds, not
  what was once sent there, decides where a prefix is cached.

Lengths are in tokens of the model's own tokenizer: text is built from words, encoded, cut to the
target and decoded, and re-measured so a prompt never exceeds its target.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol

# Plain English words: prompts made of them tokenize like ordinary text.
_WORDS = (
    "the of and to in is was that for on with as by at from his her they this have are not but had which one "
    "all were when there can more if out so said what about into than them some could time two may then do first "
    "any like now my such make over our even most made after also did many before must through back years where "
    "much your way well down should because each just those people how too little state good very world still own "
    "see men work long here between both life being under never day same another know while last might us great "
    "old year off come since against go came right used take three states himself few house use during without "
    "again place around however home small found thought went say part once general high upon school every does "
    "got united left number course war until always away something fact though water less public put think almost "
    "hand enough far took head yet government system better set told nothing night end why called didn find going "
    "look asked later knew point next program city business give group toward young days let room president side "
    "social given present several order national possible rather second face per among form important often things "
    "early become others white case large big need four within felt children along saw best church ever least power"
).split()


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: `fixed:N`, `uniform:LO:HI` or `normal:MEAN:STD` (clipped to >= 1)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str | int) -> LengthDist:
        if isinstance(spec, int) or str(spec).isdigit():
            return cls("fixed", float(spec))
        kind, *nums = str(spec).split(":")
        try:
            values = [float(n) for n in nums]
        except ValueError:
            raise ValueError(f"bad length distribution {spec!r}: numbers expected") from None
        if kind == "fixed" and len(values) == 1 and values[0] >= 1:
            return cls(kind, values[0])
        if kind == "uniform" and len(values) == 2 and 1 <= values[0] <= values[1]:
            return cls(kind, values[0], values[1])
        if kind == "normal" and len(values) == 2 and values[0] >= 1 and values[1] >= 0:
            return cls(kind, values[0], values[1])
        raise ValueError(f"bad length distribution {spec!r}; use fixed:N, uniform:LO:HI or normal:MEAN:STD")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(rng.gauss(self.a, self.b)))

    @property
    def upper(self) -> float:
        """The largest value it can give (inf for normal)."""
        return {"fixed": self.a, "uniform": self.b}.get(self.kind, float("inf"))

    def __str__(self) -> str:
        return {"fixed": f"fixed:{int(self.a)}", "uniform": f"uniform:{int(self.a)}:{int(self.b)}"}.get(
            self.kind, f"normal:{self.a:g}:{self.b:g}")


@dataclass
class Turn:
    text: str  # the user's message for this turn
    prompt_tokens: int  # tokens of `text` alone (the history and template add to what the server sees)
    max_tokens: int


@dataclass
class Session:
    index: int
    turns: list[Turn]
    system: str | None = None  # a system prompt sent before the turns (shared-prefix groups)
    group: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    model: str | None = None  # the model its requests name, where not the run's (a LoRA adapter)


class TextMaker:
    """Text of an exact token length (never more), from seeded word sequences."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def make(self, tokens: int, rng: random.Random) -> tuple[str, int]:
        words = " ".join(rng.choice(_WORDS) for _ in range(tokens + 8))  # a word is at least one token
        ids = self.tokenizer.encode(words, add_special_tokens=False)[:tokens]
        while ids:
            text = self.tokenizer.decode(ids).strip()
            measured = self.count(text)
            if measured <= tokens:
                return text, measured
            ids = ids[:-1]  # decoding can merge pieces into more tokens; shorten until it fits
        return "", 0


def random_workload(maker: TextMaker, requests: int, input_len: LengthDist, output_len: LengthDist,
                    seed: int) -> list[Session]:
    rng = random.Random(seed)
    sessions = []
    for i in range(requests):
        text, n = maker.make(input_len.sample(rng), rng)
        sessions.append(Session(i, [Turn(text, n, output_len.sample(rng))]))
    return sessions


def shared_prefix_workload(maker: TextMaker, groups: int, users: int, system_len: int, question_len: LengthDist,
                           output_len: LengthDist, seed: int) -> list[Session]:
    rng = random.Random(seed)
    systems = [maker.make(system_len, rng)[0] for _ in range(groups)]
    sessions = []
    for g in range(groups):
        for u in range(users):
            text, n = maker.make(question_len.sample(rng), rng)
            sessions.append(Session(0, [Turn(text, n, output_len.sample(rng))], system=systems[g], group=g,
                                    meta={"user": u}))
    rng.shuffle(sessions)  # groups interleave, as real traffic does
    for i, session in enumerate(sessions):
        session.index = i
    return sessions


def multi_turn_workload(maker: TextMaker, conversations: int, turns: int, turn_len: LengthDist,
                        output_len: LengthDist, seed: int) -> list[Session]:
    rng = random.Random(seed)
    sessions = []
    for c in range(conversations):
        chat = []
        for _ in range(turns):
            text, n = maker.make(turn_len.sample(rng), rng)
            chat.append(Turn(text, n, output_len.sample(rng)))
        sessions.append(Session(c, chat))
    return sessions


def adapter_workload(maker: TextMaker, adapters: list[str], requests: int, zipf_s: float, input_len: LengthDist,
                     output_len: LengthDist, seed: int) -> list[Session]:
    """`requests` requests over `adapters`, the k-th adapter (1-based) chosen with weight 1 / k^zipf_s."""
    if not adapters:
        raise ValueError("the adapters workload needs adapter names")
    rng = random.Random(seed)
    weights = [1 / (k ** zipf_s) for k in range(1, len(adapters) + 1)]
    sessions = []
    for i in range(requests):
        text, n = maker.make(input_len.sample(rng), rng)
        sessions.append(Session(i, [Turn(text, n, output_len.sample(rng))],
                                model=rng.choices(adapters, weights)[0]))
    return sessions


def kv_pressure_workload(maker: TextMaker, groups: int, sessions: int, turns: int, system_len: int,
                         turn_len: LengthDist, output_len: LengthDist, zipf_s: float, seed: int,
                         fan_out: int = 1) -> list[Session]:
    """`sessions` conversations of `turns` turns each, under G groups' system prompts of `system_len`
    tokens; a session joins the k-th group (1-based) with weight 1 / k^zipf_s. Each turn resends the
    conversation so far (the system prompt, every earlier question and the server's answers to them) plus
    a new user message, so a session's prompt grows by a turn and an answer each time.

    The sessions come in the order their groups were drawn (groups interleave), and a run keeps several in
    flight at once, so their turns interleave in time as real traffic does. `fan_out` > 1: each draw of a
    group makes that many consecutive sessions of it (an agent's parallel calls, a team arriving together;
    `--burst` starts them at once), each with its own messages."""
    if groups < 1 or sessions < 1 or turns < 1 or fan_out < 1:
        raise ValueError("the kv-pressure workload needs at least one group, session, turn and session per draw")
    rng = random.Random(seed)
    systems = [maker.make(system_len, rng) for _ in range(groups)]
    weights = [1 / (k ** zipf_s) for k in range(1, groups + 1)]
    out = []
    g = 0
    for i in range(sessions):
        if i % fan_out == 0:
            g = rng.choices(range(groups), weights)[0]
        chat = []
        for _ in range(turns):
            text, n = maker.make(turn_len.sample(rng), rng)
            chat.append(Turn(text, n, output_len.sample(rng)))
        system, system_tokens = systems[g]
        out.append(Session(i, chat, system=system, group=g, meta={"system_tokens": system_tokens}))
    return out


def kv_pressure_sizing(sessions: list[Session]) -> dict[str, Any]:
    """How many distinct prompt tokens a workload of system-prompt sessions holds: each group's system
    prompt once, plus every session's own history (its user messages, and the answers to all but its last
    turn, counted at `max_tokens`: ignore_eos makes the answers that long). The chat template's few tokens
    per message are left out, so this slightly undercounts; `shunter.bench.kv_oracle` counts the exact
    distinct 128-token blocks of the prompts a run really sent."""
    systems = {s.group: s.meta.get("system_tokens", 0) for s in sessions}
    own = sum(sum(t.prompt_tokens for t in s.turns) + sum(t.max_tokens for t in s.turns[:-1]) for s in sessions)
    longest = max((s.meta.get("system_tokens", 0) + sum(t.prompt_tokens + t.max_tokens for t in s.turns)
                   for s in sessions), default=0)
    return {"distinct_prefix_tokens": sum(systems.values()) + own, "system_prefix_tokens": sum(systems.values()),
            "session_history_tokens": own, "groups_used": len(systems),
            "longest_session_tokens": longest}


def describe(sessions: list[Session]) -> dict[str, Any]:
    """Counts a result file records about its workload."""
    turns = [t for s in sessions for t in s.turns]
    return {"sessions": len(sessions), "requests": len(turns),
            "prompt_tokens_total": sum(t.prompt_tokens for t in turns),
            "max_tokens_total": sum(t.max_tokens for t in turns),
            "groups": len({s.group for s in sessions if s.group is not None}),
            "models": len({s.model for s in sessions if s.model is not None})}
