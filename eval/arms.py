"""The arms of a sweep: ways of decoding (plain, lossless speculative decoding, FSD with its divergence, rule,
threshold and guards, on the model's draft tree or another) and the --fsd / --thresholds specs that name them.

    "kl_qp:0.3,1"         kl_qp (reducible rule) at T = 0.3 and 1
    "kl_qp/original:1"    the original rule at T = 1
    "kl_qp+stop+r4:2"     with guards (GUARD_CODES): stop tokens kept, top r, margin mX, entropy hX
    "kl_qp:2@16/5/2"      on the draft tree 16/5/2; "lossless@16/5/2": lossless decoding on it
"""
from __future__ import annotations

from dataclasses import dataclass

from eagle_fsd.fsd import DIVERGENCES, FSD_MODES, FsdConfig
from eagle_fsd.settings import Settings
from eagle_fsd import steps
from eagle_fsd.tree.shape import TreeShape

PLAIN, LOSSLESS = "plain", "lossless"


@dataclass(frozen=True)
class Arm:
    """One way of decoding: plain (the target alone), lossless speculative decoding (fsd None), or FSD; on the
    model's own draft tree, or on `shape` (e.g. a deeper tree, which gives FSD more to accept)."""

    label: str
    fsd: FsdConfig | None = None
    plain: bool = False
    shape: TreeShape | None = None

    @property
    def tree(self) -> str | None:
        """The arm's own tree as N/D/K[/V] (None: the model's)."""
        return tree_label(self.shape)


def tree_label(shape: TreeShape | None) -> str | None:
    """TreeShape(16, 5, 2) -> "16/5/2" (with "/V" for a draft vocabulary of V tokens); None -> None."""
    return None if shape is None else steps.tree_label(shape)


def on_tree(label: str, shape: TreeShape | None) -> str:
    """An arm's label, with " @N/D/K" when it runs on its own tree."""
    return label if shape is None else f"{label} @{tree_label(shape)}"


GUARD_CODES = {"stop": "keep_stop", "r": "top_r", "m": "margin", "h": "min_entropy"}  # "+stop+r4+m2+h0.5"


def parse_guards(codes: list[str]) -> dict:
    """["stop", "r4", "m2", "h0.5"] -> FsdConfig's guard fields: keep_stop, top_r 4, margin 2 nats, min_entropy 0.5
    nats."""
    guards = {}
    for code in codes:
        if code == "stop":
            guards["keep_stop"] = True
            continue
        name = GUARD_CODES.get(code[:1])
        try:
            guards[name] = int(code[1:]) if name == "top_r" else float(code[1:])
        except ValueError:
            name = None
        if name is None:
            raise SystemExit(f"guard {code!r}: expected stop, rN (top r), mX (margin in nats) or hX (entropy in nats)")
    return guards


def guard_label(guards: dict) -> str:
    """The "+stop+r4" part of an arm's label, in GUARD_CODES order."""
    codes = {v: k for k, v in GUARD_CODES.items()}
    return "".join(f"+{codes[name]}" + ("" if name == "keep_stop" else f"{guards[name]:g}")
                   for name in GUARD_CODES.values() if guards.get(name) not in (None, False))


def guards_of(fsd: FsdConfig) -> dict:
    """The guard fields of an FsdConfig that are on."""
    fields = {"keep_stop": fsd.keep_stop, "top_r": fsd.top_r, "margin": fsd.margin, "min_entropy": fsd.min_entropy}
    return {name: value for name, value in fields.items() if value not in (None, False)}


def fsd_arm(divergence: str, mode: str, threshold: float, exact_prefix: int = 0, shape: TreeShape | None = None,
            guards: dict | None = None) -> Arm:
    rule = "" if mode == "reducible" else f" {mode}"
    guards = guards or {}
    return Arm(on_tree(f"{divergence}{guard_label(guards)}{rule} T={threshold:g}", shape),
               FsdConfig(threshold, divergence, mode, exact_prefix=exact_prefix, **guards), shape=shape)


def parse_tree(text: str) -> TreeShape:
    """"16/5/2" or "16/5/2/37888" -> TreeShape(total_token, depth, branching[, draft_vocab])."""
    try:
        return TreeShape(*(int(v) for v in text.split("/")))
    except (TypeError, ValueError) as err:
        raise SystemExit(f"tree {text!r}: expected TOTAL_TOKEN/DEPTH/TOP_K[/DRAFT_VOCAB] of positive ints, e.g. "
                         f"16/5/2 ({err})") from None


def parse_thresholds(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"thresholds {text!r}: expected comma-separated numbers, e.g. 0.1,0.3,1") from None
    if any(not v >= 0 for v in values):
        raise SystemExit(f"thresholds {text!r}: thresholds must be >= 0")
    return values


def parse_arm_spec(spec: str, exact_prefix: int = 0) -> list[Arm]:
    """"kl_qp:0.3,1" -> kl_qp (reducible) at T = 0.3 and 1; "kl_qp/original:1" -> the original rule at T = 1;
    guards after the divergence: "kl_qp+stop+r4:2" (eagle_fsd.fsd: stop tokens kept, top r, margin mX, entropy hX);
    a suffix "@16/5/2[/V]" runs them on that draft tree; "lossless@16/5/2" is lossless decoding on it."""
    spec_arms, _, tree = spec.partition("@")
    shape = parse_tree(tree) if tree else None
    if spec_arms == LOSSLESS and shape is not None:
        return [Arm(on_tree(LOSSLESS, shape), shape=shape)]
    head, _, values = spec_arms.partition(":")
    divergence, _, mode = head.partition("/")
    divergence, *codes = divergence.split("+")
    mode = mode or "reducible"
    if not values or divergence not in DIVERGENCES or mode not in FSD_MODES:
        raise SystemExit(f"--fsd {spec!r}: expected DIVERGENCE[/RULE]:T1,T2,...[@N/D/K] with DIVERGENCE one of "
                         f"{', '.join(DIVERGENCES)} and RULE one of {', '.join(FSD_MODES)}, e.g. kl_qp:0.3,1, or "
                         "lossless@N/D/K")
    guards = parse_guards(codes)
    return [fsd_arm(divergence, mode, t, exact_prefix, shape, guards) for t in parse_thresholds(values)]


def arms_of(settings: Settings, thresholds: str | None, specs: list[str]) -> list[Arm]:
    """Plain, lossless, then the FSD arms (--thresholds with the settings' divergence and rule, then each --fsd)."""
    fsd = settings.fsd
    arms = [Arm(PLAIN, plain=True), Arm(LOSSLESS)]
    if thresholds:
        arms += [fsd_arm(fsd.divergence, fsd.mode, t, fsd.exact_prefix) for t in parse_thresholds(thresholds)]
    for spec in specs:
        arms += parse_arm_spec(spec, fsd.exact_prefix)
    return list({arm.label: arm for arm in arms}.values())  # a configuration named twice runs once
