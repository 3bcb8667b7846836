"""The properties an attention backend must have, each with the bug classes it targets.

A `Property` pairs a check of `attnref.conformance.checks` (an agreement with the float64
oracle, or a law relating two calls of the backend) with the family of Hypothesis-drawn
cases it runs on, the capabilities it needs and its explicit examples. `PROPERTIES` is
the registry the audit, the CLI, the plugin and the kill matrix read.
Bug classes are the rows of the catalogue in docs/architecture.md ("Bug classes").
"""

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from hypothesis import strategies as st

from attnref.conformance import attacks, checks
from attnref.conformance.cases import Case, fixed_grid, long_grid, variant_grid
from attnref.conformance.checks import Check, Context
from attnref.conformance.declarations import Capabilities
from attnref.conformance.profiles import Profile
from attnref.conformance.strategies import (
    GROUPS,
    LAYOUTS,
    case_strategy,
    masks_for,
    variant_fields,
)

__all__ = [
    "JUDGE_CLASS",
    "PROPERTIES",
    "Context",
    "Property",
    "get_property",
    "matrix_properties",
    "register",
    "some_variants",
]

Cases = Callable[[Profile, Capabilities], st.SearchStrategy[Case]]


def _no_requirement(caps: Capabilities) -> str | None:
    return None


def _no_examples(profile: Profile, caps: Capabilities) -> list[Case]:
    return []


@dataclass(frozen=True)
class Property:
    """One property: an id, what it checks, the bug classes it targets, how to check it."""

    id: str
    summary: str
    classes: tuple[int, ...]
    cases: Cases
    check: Check
    #: why a backend with these capabilities cannot be held to this property, or None
    requires: Callable[[Capabilities], str | None] = field(default=_no_requirement)
    #: explicit cases, run once Hypothesis' own search has found nothing
    examples: Callable[[Profile, Capabilities], list[Case]] = field(default=_no_examples)
    gradient: bool = False
    #: the API families whose calls it needs (empty: every family; a dense case runs in
    #: each of them); a family's own properties name it
    families: tuple[str, ...] = ()
    #: why it cannot be met by a narrow declaration: it needs calls with Tq != Tk
    #: (``cross``) or calls that are not causal (``non_causal``)
    needs: tuple[str, ...] = ()

    def applies_to(self, api: str) -> bool:
        """Whether a backend of API family ``api`` can be held to this property: a
        family's own, or a dense property where the family takes dense cases."""
        if self.families:
            return api in self.families
        from attnref.conformance.family import FAMILIES

        family = FAMILIES.get(api)
        return family is None or family.dense

    def why_not(self, caps: Capabilities) -> str | None:
        """Why a backend that declares ``caps`` cannot be held to this property (a
        capability it lacks, or calls its narrow declaration rules out), or None."""
        reason = self.requires(caps)
        if reason is not None:
            return reason
        if "cross" in self.needs and caps.self_attention_only:
            return f"needs calls with Tq != Tk ({_CROSS[self.id]}); self-attention only declared"
        if "non_causal" in self.needs and caps.causal_only:
            return f"needs calls that are not causal ({_NON_CAUSAL[self.id]}); causal only declared"
        return None


#: what a property does with Tq != Tk, and with non-causal calls (its skip reason)
_CROSS = {
    "decode": "one query against its visible prefix",
    "merge": "attention over a part of the keys",
}
_NON_CAUSAL = {
    "key_permutation": "permuting keys moves them across the causal diagonal",
    "merge": "attention over a part of the keys",
}


# ------------------------------------------------------------------------ registry


def _needs(flag: str, what: str) -> Callable[[Capabilities], str | None]:
    def requires(caps: Capabilities) -> str | None:
        return None if getattr(caps, flag) else f"{what} not declared"

    return requires


def _masks_and_floats(caps: Capabilities) -> str | None:
    if not (caps.bool_mask and caps.float_mask):
        return "needs both boolean and float masks"
    return None


_HIDING = ("padding", "columns", "bool", "bool_full")


def _poisons(caps: Capabilities) -> st.SearchStrategy[str]:
    return st.sampled_from(
        ("garbage", "nan", "inf") if caps.masked_nan == "contained" else ("garbage",)
    )


def _degenerate(p: Profile, c: Capabilities) -> st.SearchStrategy[Case]:
    dims = st.sampled_from((0, 1, 2, 8)) if c.zero_head_dim else st.sampled_from((1, 2, 8))
    families = [
        case_strategy("degenerate", p, c, Tq=1),
        case_strategy("degenerate", p, c, Tk=1),
        case_strategy("degenerate", p, c, Dh=dims, Dv=dims, Tq=st.sampled_from((1, 2, 5))),
    ]
    if c.distinct_value_dim:  # drawn inside the declaration, never skipped outside it
        families.append(case_strategy("degenerate", p, c, Dh=dims, Dv=st.sampled_from((1, 3, 16))))
    if c.zero_head_dim and c.distinct_value_dim:
        families.append(case_strategy("degenerate", p, c, Dh=0, Dv=st.sampled_from((8, 1, 3))))
    return st.one_of(*families)


def _large_index(p: Profile, c: Capabilities) -> st.SearchStrategy[Case]:
    @st.composite
    def draw(draw: st.DrawFn) -> Case:
        g = draw(st.integers(1, p.max_kv_heads))
        Tk = draw(st.sampled_from((p.tail_lengths[-1], 97, 160)))
        B = -(-p.large_rows // (g * Tk))  # enough key rows to pass large_rows
        Dh = draw(st.sampled_from((1, 2, 4)))
        # inside the declaration, as every property draws: Dv == Dqk where it must be
        Dv = draw(st.sampled_from((1, 2))) if c.distinct_value_dim else Dh
        return Case(
            "large_index",
            batch=(B,),
            h=g * draw(st.sampled_from((1, 2)) if c.gqa else st.just(1)),
            g=g,
            Tq=draw(st.sampled_from((1, 2, 3))),
            Tk=Tk,
            Dh=Dh,
            Dv=Dv,
            mask=draw(st.sampled_from(masks_for(c, ("none", "padding")))),
            seed=draw(st.integers(0, 2**16)),
        )

    return draw()


def _alignments(c: Capabilities) -> st.SearchStrategy[str]:
    """Both causal alignments, or only those declared by a backend that takes no mask
    (an undeclared one cannot reach it folded into a mask)."""
    if not c.bool_mask:
        return st.sampled_from(c.causal_alignments)
    return st.sampled_from(("top_left", "bottom_right"))


#: one plain case: the late-write check waits a moment after each call, so it runs once
_SETTLED = Case("settled_output", batch=(2,), h=2, g=2, Tq=7, Tk=13, Dh=8, Dv=8, seed=3)


def _can_empty_a_row(caps: Capabilities) -> str | None:
    """A query sees no key under a mask, or under bottom-right causal with Tq > Tk."""
    if caps.self_attention_only and not (caps.bool_mask or caps.float_mask):
        return (
            "no declared call leaves a query without keys: self-attention only (a query "
            "always sees its own position) and no masks"
        )
    if caps.queries_at_most_keys and not (caps.bool_mask or caps.float_mask):
        return (
            "no declared call leaves a query without keys: no more queries than keys (a "
            "query always sees the key at its own position) and no masks"
        )
    return None


def _empty_row_cases(p: Profile, c: Capabilities) -> st.SearchStrategy[Case]:
    masked = case_strategy(
        "empty_rows", p, c, mask=st.sampled_from(masks_for(c, ("empty_rows", "float_empty_rows")))
    )
    if c.self_attention_only or c.queries_at_most_keys:  # bottom-right with Tq > Tk is not
        return masked  # declared
    return st.one_of(
        masked,
        case_strategy(
            "empty_rows", p, c, causal="bottom_right", Tq=st.integers(2, p.max_len),
            Tk=st.integers(1, 8),
        ),
    )  # fmt: skip


def _any_variant(caps: Capabilities) -> str | None:
    return None if caps.variants() else "no variant (window, softcap, ALiBi, sinks) declared"


def needs_lse(caps: Capabilities) -> str | None:
    """A property that reads the log-sum-exp needs a backend that returns it."""
    return None if caps.lse else "the log-sum-exp not declared"


def some_variants(c: Capabilities, positional: bool = True) -> st.SearchStrategy[dict[str, object]]:
    """No variant, or some of those declared (the gradient, LSE and merge properties)."""
    if not c.variants():
        return st.just({})
    return st.one_of(st.just({}), variant_fields(c, positional=positional))


def _with_sinks(c: Capabilities) -> st.SearchStrategy[dict[str, object]]:
    """Variants with the sink always on (others as declared, when they combine)."""
    if not c.combined_variants:
        return variant_fields(c, only="sinks")
    return variant_fields(c).map(lambda v: {**v, "sinks": True})


def _softcap_cases(p: Profile, c: Capabilities) -> st.SearchStrategy[Case]:
    """Hot scores (so that an uncapped score leaves ``(-c, c)``), small caps, enough keys
    for the bound to bite, no float mask or ALiBi (they add to the capped score)."""
    cases = case_strategy(
        "softcap_bound",
        p,
        c,
        variants=st.sampled_from((0.25, 0.5, 1.0, 2.0)).map(lambda cap: {"softcap": cap}),
        mask=st.sampled_from(masks_for(c, ("none", "bool", "padding"))),
        amp=st.sampled_from((4.0, 8.0, 16.0)),
        Tk=st.integers(16, min(64, max(16, p.max_len))),
    )
    # V becomes the identity: Dv = Tk reads every weight in one call, where the
    # declaration takes such a Dv; else the check reads them Dv at a time (Dh = Tk, as it
    # was, drew head dims outside a declared list: 20 of 25 cases skipped)
    return cases.map(lambda x: replace(x, Dv=x.Tk) if _takes_value_dim(c, x.Dh, x.Tk) else x)


def _takes_value_dim(c: Capabilities, Dh: int, Dv: int) -> bool:
    """Whether the declaration takes a value dim ``Dv`` beside a head dim ``Dh``."""
    return (
        (Dv == Dh or c.distinct_value_dim)
        and (c.max_head_dim is None or Dv <= c.max_head_dim)
        and (not c.head_dims or Dv in c.head_dims)
        and Dv % c.head_dim_multiple == 0
    )


PROPERTIES: dict[str, Property] = {
    p.id: p
    for p in [
        Property(
            "forward",
            "output agrees with the float64 oracle over every kind of case",
            (1, 2, 4, 5, 9, 10, 14, 15, 16, 17, 20, 32, 33),
            lambda p, c: case_strategy("forward", p, c),
            checks.forward,
            examples=lambda p, c: [
                *(x for x in fixed_grid() if x.poison == "none"),
                *long_grid(),
            ],
        ),
        Property(
            "gradient",
            "dQ, dK and dV agree with the float64 oracle's, with the variants declared",
            (11, 12, 22, 23, 32),
            # its oracle is not row-sampled: its long cases keep to max_grad_work
            lambda p, c: case_strategy(
                "gradient", p, c, max_work=p.max_grad_work, variants=some_variants(c)
            ),
            checks.gradient,
            requires=_needs("gradients", "gradients"),
            gradient=True,
        ),
        Property(
            "masked_keys",
            "values (finite, or NaN/inf where the backend contains them) at keys no query "
            "sees never change the output",
            (3, 16, 32, 33),
            lambda p, c: case_strategy(
                "masked_keys",
                p,
                c,
                mask=st.sampled_from(masks_for(c, _HIDING)),
                poison=_poisons(c),
            ),
            checks.masked_keys,
            examples=lambda p, c: [
                replace(x, poison="nan" if c.masked_nan == "contained" else "garbage")
                for x in fixed_grid()
                if x.poison != "none"
            ],
        ),
        Property(
            "key_permutation",
            "permuting key/value pairs (and mask columns) together changes nothing",
            (6, 12, 13),
            lambda p, c: case_strategy("key_permutation", p, c, causal=None),
            checks.key_permutation,
            needs=("non_causal",),
        ),
        Property(
            "row_independence",
            "each output row depends only on its own query",
            (15, 17),
            lambda p, c: case_strategy("row_independence", p, c),
            checks.row_independence,
        ),
        Property(
            "causality",
            "keys after a query's causal diagonal never change its output",
            (4, 5, 32),
            lambda p, c: case_strategy("causality", p, c, causal=_alignments(c)),
            checks.causality,
        ),
        Property(
            "shift_invariance",
            "a constant added to a row of scores (through a float mask) changes nothing",
            (8, 13, 16),
            lambda p, c: case_strategy(
                "shift_invariance",
                p,
                c,
                mask=st.sampled_from(masks_for(c, ("none", "float"))),
                amp=st.sampled_from((1.0, 4.0, 8.0)),
            ),
            checks.shift_invariance,
            requires=_needs("float_mask", "float masks"),
        ),
        Property(
            "value_affine",
            "out(q, k, a*v + b) = a*out(q, k, v) + b: the weights of a row sum to 1",
            (2, 13, 15),
            lambda p, c: case_strategy("value_affine", p, c),
            checks.value_affine,
        ),
        Property(
            "decode",
            "one query at a time against its visible prefix equals the causal pass",
            (4, 10, 18, 32),
            lambda p, c: case_strategy(
                "decode",
                p,
                c,
                causal=_alignments(c),
                mask=st.sampled_from(masks_for(c, ("none", "padding", "bool", "float"))),
            ),
            checks.decode,
            needs=("cross",),
        ),
        Property(
            "gqa",
            "grouped-query attention equals attention with the KV heads expanded",
            (9, 10, 32),
            lambda p, c: case_strategy("gqa", p, c, group=GROUPS),
            checks.gqa,
            requires=_needs("gqa", "GQA"),
        ),
        Property(
            "batch",
            "each sample of a batch gives the same output alone",
            (6, 7, 17, 21, 32),
            lambda p, c: case_strategy("batch", p, c, batch=st.tuples(st.integers(2, p.max_batch))),
            checks.batch,
        ),
        Property(
            "dropout_zero",
            "dropout_p = 0 applies no dropout: calls agree with the oracle and each other",
            (19,),
            lambda p, c: case_strategy("dropout_zero", p, c),
            checks.dropout_zero,
        ),
        Property(
            "empty_rows",
            "a query with no visible key gets the declared policy (zeros by default)",
            (1, 2),
            _empty_row_cases,
            checks.forward,
            requires=_can_empty_a_row,
        ),
        Property(
            "layouts",
            "transposed, sliced (storage offset) and stride-0 broadcast inputs",
            (6, 7),
            lambda p, c: case_strategy("layouts", p, c, layout=st.sampled_from(LAYOUTS)),
            checks.forward,
        ),
        Property(
            "degenerate",
            "Tq = 1, Tk = 1, Dv != Dqk and Dqk = 0",
            (10, 18, 20),
            _degenerate,
            checks.forward,
            examples=lambda p, c: [
                *(
                    [Case("degenerate_dqk0", Dh=0, Dv=8)]
                    if c.zero_head_dim and c.distinct_value_dim
                    else []
                ),
                Case("degenerate_tk1_masked", Tk=1, mask="bool", seed=1),
                Case("degenerate_tq1_gqa", h=4, g=2, Tq=1, Tk=9, seed=2),
                *(
                    [Case("degenerate_dv_ne_dqk", Dh=16, Dv=3, seed=3)]
                    if c.distinct_value_dim
                    else []
                ),
            ],
        ),
        Property(
            "tails",
            "lengths that are not multiples of common tile sizes (31, 127, 129, primes)",
            (12, 13),
            lambda p, c: case_strategy(
                "tails",
                p,
                c,
                Tq=st.sampled_from(p.tail_lengths),
                Tk=st.sampled_from(p.tail_lengths),
                Dh=st.sampled_from((64, 80, 128, 16)),
                batch=(1,),
                g=1,
            ),
            checks.forward,
        ),
        Property(
            "hot",
            "scaled randn queries and keys: peaky softmax, scores far from zero",
            (8, 13, 33),
            lambda p, c: case_strategy("hot", p, c, amp=st.sampled_from((4.0, 8.0, 16.0, 32.0))),
            checks.forward,
        ),
        Property(
            "scale",
            "the default scale 1/sqrt(Dqk) and explicit scales",
            (14,),
            lambda p, c: case_strategy(
                "scale",
                p,
                c,
                scale=st.sampled_from((None, 0.05, 0.37, 1.0, 3.0)),
                Dh=st.sampled_from((1, 3, 16, 64, 80, 128)),
            ),
            checks.forward,
        ),
        Property(
            "mask_kinds",
            "a boolean mask and its additive float equivalent (0 / -inf) agree",
            (16, 33),
            lambda p, c: case_strategy(
                "mask_kinds",
                p,
                c,
                mask=st.sampled_from(("bool", "bool_full", "padding", "columns", "empty_rows")),
            ),
            checks.mask_kinds,
            requires=_masks_and_floats,
        ),
        Property(
            "large_index",
            "many key rows (batch * g * Tk past 2**15 in the quick profile)",
            (21,),
            _large_index,
            checks.forward,
        ),
        Property(
            "variants",
            "output agrees with the oracle under sliding windows, softcap, ALiBi and "
            "sinks, alone and combined",
            (22, 23, 24, 25),
            lambda p, c: case_strategy(
                "variants",
                p,
                c,
                variants=variant_fields(c),
                amp=st.sampled_from((1.0, 4.0, 0.5, 8.0)),
            ),
            checks.forward,
            requires=_any_variant,
            examples=lambda p, c: variant_grid(c),
        ),
        Property(
            "window_keys",
            "keys outside a query's sliding window never change its output",
            (22,),
            lambda p, c: case_strategy(
                "window_keys", p, c, variants=variant_fields(c, only="window")
            ),
            checks.window_keys,
            requires=_needs("window", "sliding windows"),
        ),
        Property(
            "window_none",
            "window (-1, -1), and the tightest window that covers every key, equal none",
            (22,),
            lambda p, c: case_strategy("window_none", p, c),
            checks.window_none,
            requires=_needs("window", "sliding windows"),
        ),
        Property(
            "softcap_bound",
            "under softcap c every effective score lies in (-c, c): weights within exp(+-2c) / n",
            (23,),
            _softcap_cases,
            checks.softcap_bound,
            requires=_needs("softcap", "softcap"),
        ),
        Property(
            "sinks",
            "a sink scales each row by sigmoid(lse - sink), and a sink of -inf is none",
            (24,),
            lambda p, c: case_strategy("sinks", p, c, variants=_with_sinks(c)),
            checks.sink_law,
            requires=_needs("sinks", "sinks"),
        ),
        Property(
            "lse",
            "the log-sum-exp agrees with the oracle's (natural log, visible keys only, "
            "the declared value for a query that sees none)",
            (25, 32, 33),
            lambda p, c: case_strategy("lse", p, c, variants=some_variants(c)),
            checks.lse,
            requires=needs_lse,
            examples=lambda p, c: variant_grid(c, lse=True),
        ),
        Property(
            "merge",
            "outputs and LSEs of a random split of the keys, merged, equal attention over "
            "all of them; a sink counts once",
            (24, 25),
            lambda p, c: case_strategy(
                "merge", p, c, causal=None, variants=some_variants(c, positional=False)
            ),
            checks.merge,
            requires=needs_lse,
            needs=("cross", "non_causal"),
        ),
        Property(
            "fresh_values",
            "outputs follow values, not addresses: new values in the same buffers, the "
            "same values in new buffers, calls interleaved and repeated",
            (31,),
            lambda p, c: case_strategy("fresh_values", p, c, batch=st.just((1,))),
            attacks.fresh_values,
        ),
        Property(
            "settled_output",
            "the output as it stood at the return is right, and unchanged a moment later "
            "(no thread or stream still writing it)",
            (31,),
            lambda p, c: st.just(_SETTLED),
            attacks.settled_output,
        ),
    ]
}


#: the bug class of attacks on the judge: its properties are proven on the backends of
#: tests/hostile, not on the mutants
JUDGE_CLASS = 31


def register(properties: tuple[Property, ...]) -> None:
    """Add a family's own properties to `PROPERTIES` (what installing a family does), in
    place: after the properties of attention bugs, before those of attacks on the judge."""
    ids = [p.id for p in properties]
    taken = [pid for pid in ids if pid in PROPERTIES]
    if taken:
        raise ValueError(f"property {taken[0]!r} is defined twice")
    judged = {pid: p for pid, p in PROPERTIES.items() if JUDGE_CLASS in p.classes}
    for pid in judged:
        del PROPERTIES[pid]
    PROPERTIES.update({p.id: p for p in properties})
    PROPERTIES.update(judged)


def matrix_properties() -> tuple[str, ...]:
    """The properties of the kill matrix (docs/kill-matrix.md): those aimed at attention
    bugs, of every installed family."""
    return tuple(pid for pid, p in PROPERTIES.items() if JUDGE_CLASS not in p.classes)


def get_property(pid: str) -> Property:
    """The property called ``pid``; a clear error for an unknown one."""
    try:
        return PROPERTIES[pid]
    except KeyError:
        raise ValueError(f"unknown property {pid!r}: use one of {', '.join(PROPERTIES)}") from None
