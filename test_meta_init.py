"""Tests for meta_init.py: models no rank holds whole, built on the meta device and
initialized unit by unit inside wrap(), and loaded shard by shard.

- The weights are those of the normally built model given the same init, at every stage and with
  hybrid sharding: test_meta_model_equals_the_normally_built_one.
- Building holds one unit at a time: test_building_a_meta_model_holds_one_unit_at_a_time.
- load_full_state_dict reads only each rank's own elements and refuses what does not fit:
  test_load_full_state_dict_reads_only_each_ranks_own_elements.
- Clear refusals: test_meta_models_refused_clearly; a transformers-shaped model:
  test_transformers_shaped_model_on_the_meta_device.
"""
import math
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zero
from conftest import B, CASES, D, T, V, Net, run_steps, scenario

def net_init(m):
    """An init for Net, module by module: reset_parameters() where torch has one, and Net's own
    buffer (which has none)."""
    if isinstance(m, Net):
        nn.init.uniform_(m.scale, 0.5, 1.5)
    elif hasattr(m, "reset_parameters"):
        m.reset_parameters()


def normally_initialized(seed=7):
    """The contract's reference: Net built normally, then model.apply(net_init) (children
    first), after torch.manual_seed(seed)."""
    model = Net(seed=100)
    torch.manual_seed(seed)
    return model.apply(net_init)


@scenario(2, 4)
def meta_models(rank, world):
    """Meta-built Nets at every stage (N = 2) and with hybrid sharding (N = 4, G = 2): the weights
    wrap() gives them, the model-state bytes at every event of wrap(), and 2 steps of training,
    against the same Net built normally and wrapped."""
    out, rows = {}, slice(rank * B, (rank + 1) * B)
    G = 2 if world == 4 else None
    for stage in range(1 if G else 0, 4):
        seen, event = [], zero.Meter.event

        def record(meter, what, unit=None):  # every event of wrap(): what is really held then
            event(meter, what, unit)
            if not hasattr(meter.zero, "optimizer"):
                seen.append((what, meter.breakdown()))
        zero.Meter.event = record
        try:
            with torch.device("meta"):
                model = Net(seed=100 + rank)  # (ranks' seeds differ: wrap() broadcasts rank 0's)
            torch.manual_seed(7)
            opt = zero.wrap(model, stage, CASES["adamw"]["optimizer"], init=net_init, shard_size=G)
        finally:
            zero.Meter.event = event
        ref = normally_initialized()
        ref_model, ref_opt = ref, zero.wrap(ref, stage, CASES["adamw"]["optimizer"], shard_size=G)
        rec = {"full": opt.full_state_dict(), "seen": seen, "build_peak": dict(opt.build_peak),
               "normal_build_peak": dict(ref_opt.build_peak),
               "replicated": {n: t.clone() for n, t in zero.replicated(model)},
               "flat": [u.flat.numel() for u in opt.units], "S": [u.S for u in opt.units],
               "root": [not u.modules for u in opt.units],
               "tied": model.head.weight is model.emb.weight,
               "psi": opt.psi}
        for m, o in ((model, opt), (ref_model, ref_opt)):
            run_steps(m, o, o.clip_grad_norm_, CASES["adamw"], rows, world, 2)
        rec["trained"], rec["ref_trained"] = opt.full_state_dict(), ref_opt.full_state_dict()
        out[stage] = rec
    # load_full_state_dict: a state_dict whose elements outside this rank's shards are NaN (each
    # rank its own copy): only the elements a rank holds may be read. And wrong keys or shapes.
    want = {k: v.clone() + 1 for k, v in normally_initialized().state_dict().items()}
    for stage in range(1 if G else 0, 4):
        with torch.device("meta"):
            model = Net(seed=100)
        opt = zero.wrap(model, stage, CASES["adamw"]["optimizer"], init=net_init, shard_size=G,
                        units=list(model.blocks))
        sharded = {k for k, t in model.state_dict(keep_vars=True).items() if t.requires_grad}
        poisoned = {k: v.clone() for k, v in want.items()}
        for k, v in poisoned.items():
            if k in sharded:  # (frozen parameters and buffers: every rank reads them whole)
                v.fill_(float("nan"))
        for u in opt.units:
            for p in u.params:
                a, b = (max(u.offset[p], u.my_slice.start),
                        min(u.offset[p] + p.numel(), u.my_slice.stop))
                if a < b:
                    for key in [k for k, t in model.state_dict(keep_vars=True).items() if t is p]:
                        poisoned[key].view(-1)[a - u.offset[p]:b - u.offset[p]] = \
                            want[key].view(-1)[a - u.offset[p]:b - u.offset[p]]
        opt.load_full_state_dict(poisoned)
        loaded = opt.full_state_dict()
        run_steps(model, opt, opt.clip_grad_norm_, CASES["adamw"], rows, world, 1)
        trained, refused = opt.full_state_dict(), []
        for bad in ({k: v for k, v in want.items() if k != "norm.weight"},
                    dict(want, extra=torch.zeros(1)),
                    dict(want, **{"blocks.0.0.weight": torch.zeros(2, 2)}),
                    dict(want, scale=torch.zeros(D, dtype=torch.long)),
                    dict(want, **{"head.weight": want["head.weight"] + 1})):  # untied there
            try:
                opt.load_full_state_dict(bad)
                refused.append(None)
            except ValueError as e:
                refused.append(str(e))
        out[("load", stage)] = {"loaded": loaded, "trained": trained, "refused": refused,
                                "after": opt.full_state_dict()}  # (refused: nothing changed)
    return out


@pytest.fixture(scope="module")
def meta_runs(ran):
    return {2: ran(meta_models, 2), 4: ran(meta_models, 4)}


@pytest.mark.parametrize("world,stage", [(2, s) for s in range(4)] + [(4, s) for s in range(1, 4)],
                         ids=lambda x: str(x))
def test_meta_model_equals_the_normally_built_one(meta_runs, world, stage):
    # Bit for bit: the weights wrap(init=net_init) gives a meta-built Net are those of a Net built
    # normally and given net_init module by module after the same seed (frozen layer and buffer
    # too), the tie kept; and it trains exactly as that model wrapped the usual way.
    ref = normally_initialized()
    for res in meta_runs[world]:
        rec = res[stage]
        assert rec["tied"]
        for n, p in ref.named_parameters():
            assert torch.equal(rec["full"][n], p.detach()), n
        whole = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
        assert sorted(rec["replicated"]) == ["frozen.bias", "frozen.weight", "scale"]
        for n, t in rec["replicated"].items():
            assert torch.equal(t, whole[n]), n
        for n, t in rec["ref_trained"].items():
            assert torch.equal(rec["trained"][n], t), n


@pytest.mark.parametrize("world,stage", [(2, s) for s in range(4)] + [(4, s) for s in range(1, 4)],
                         ids=lambda x: str(x))
def test_building_a_meta_model_holds_one_unit_at_a_time(meta_runs, world, stage):
    # The model-state bytes after every event of wrap(), counted from the storages really
    # allocated (memory_breakdown). Stage 3: this rank's shards, the root unit and one other unit
    # at the most, never every unit whole, as building the model normally does. Stages 0-2: no
    # more than the stage's own state (full parameters; its gradient buffers).
    for res in meta_runs[world]:
        rec = res[stage]
        unit_bytes = [4 * n for n in rec["flat"]]
        shard_bytes = sum(4 * s for s in rec["S"])
        root = sum(b for b, is_root in zip(unit_bytes, rec["root"]) if is_root)
        other = max(b for b, is_root in zip(unit_bytes, rec["root"]) if not is_root)
        held = [m["params"] for _, m in rec["seen"]]
        assert len(rec["seen"]) >= len(unit_bytes) and rec["build_peak"]["params"] == max(held)
        if stage == 3:
            assert max(held) <= shard_bytes + root + other
            assert max(held) < sum(unit_bytes) == rec["normal_build_peak"]["params"]
            assert held[-1] == shard_bytes  # and in the end only the shards
        else:
            assert max(held) == sum(unit_bytes)
            grads = sum(unit_bytes) if stage < 2 else shard_bytes
            assert max(m["grads"] for _, m in rec["seen"]) <= grads


@pytest.mark.parametrize("world,stage", [(2, s) for s in range(4)] + [(4, s) for s in range(1, 4)],
                         ids=lambda x: str(x))
def test_load_full_state_dict_reads_only_each_ranks_own_elements(meta_runs, world, stage):
    # Every element outside a rank's shards was NaN in what that rank was given: the loaded weights
    # are the state_dict's own on every rank, so each rank read its own elements only (stages 0-2
    # all-gather the rest). Wrong keys, shapes and dtypes, a tied weight's two names with two
    # values (torch would load the last, transformers the first): one line naming the key.
    want = {k: v + 1 for k, v in normally_initialized().state_dict().items()}
    for res in meta_runs[world]:
        rec = res[("load", stage)]
        for n, t in rec["loaded"].items():
            assert torch.equal(t, want[n]), n
        assert all(torch.isfinite(t).all() for t in rec["trained"].values())
        assert all(torch.equal(t, rec["trained"][n]) for n, t in rec["after"].items())
        missing, extra, shape, dtype, untied = rec["refused"]
        assert missing and "no 'norm.weight'" in missing
        assert extra and "'extra' is not in the model" in extra
        assert shape and "'blocks.0.0.weight' is (2, 2)" in shape
        assert dtype and "'scale' is" in dtype and "torch.int64" in dtype
        assert untied and "tied here, different there: " in untied and "head.weight" in untied
        assert all("\n" not in e and e.startswith("zero: load_full_state_dict")
                   for e in rec["refused"])


def test_meta_models_refused_clearly(one_rank):
    # A module with meta tensors and no reset_parameters (Net's own buffer) under the default
    # init; an init that leaves a tensor unset; some parameters on the meta device and some not;
    # init= for a model that is not on the meta device. One line each, naming what.
    optimizer = CASES["adamw"]["optimizer"]
    cases = []
    with torch.device("meta"):
        cases.append((Net(0), {}, "the model (Net) has tensors on the meta device "
                                  "and no reset_parameters()"))
        cases.append((Net(0), {"init": lambda m: None}, "blocks.0.0.weight is not initialized"))
        cases.append((Net(0), {"init": lambda m: isinstance(m, Net) or net_init(m)},
                      "scale is not initialized"))
        half = Net(0)
    half.norm = nn.LayerNorm(D)
    cases.append((half, {"init": net_init}, "norm.weight is on cpu"))
    cases.append((Net(0), {"init": net_init}, "init is for a model built on the meta device"))
    with torch.device("meta"):  # an init writing into a unit not allocated yet, or already cut
        late, early = Net(0), Net(0)
    cases.append((late, {"init": lambda m: net_init(m)
                         or m is late.emb and late.blocks[1][0].weight.data.zero_()},
                  "init(emb) writes to a tensor of a unit that is not allocated yet (zero_)"))
    cases.append((early, {"init": lambda m: net_init(m)
                          or m is early.norm and early.blocks[0][0].bias.data.zero_()},
                  "init(norm) writes to a tensor of a unit that is built already (zero_)"))
    with torch.device("meta"):  # an init replacing a parameter instead of setting it
        replaced = Net(0)
    cases.append((replaced, {"init": lambda m: net_init(m) or m is replaced.norm and setattr(
        m, "weight", nn.Parameter(torch.ones(D)))}, "init() replaced a parameter of norm"))
    for device in ("cuda:99", "xpu"):  # a GPU it cannot see, another kind of device
        with torch.device("meta"):
            cases.append((Net(0), {"init": net_init, "device": device}, f"device='{device}': "
                          "build on cpu, or on a CUDA GPU it sees"))
    for model, kwargs, message in cases:
        with pytest.raises(ValueError) as e:
            zero.wrap(model, 3, optimizer, **kwargs)
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_transformers_shaped_model_on_the_meta_device(one_rank):
    # The shape the transformers library builds: blocks nested in model.transformer.h, the head
    # tied to the embedding, an init that is a method taking a module (model._init_weights, with
    # GPT-2's scaled init of the residual projections, which a block's init applies over what
    # its children's init drew: so the order of model.apply, children first), a non-persistent
    # buffer. Built on the meta device and wrapped at stage 3 with init=model._init_weights: the
    # contract holds, the scaled init included.
    ref = HFLike()
    torch.manual_seed(11)
    ref.apply(ref._init_weights)
    with torch.device("meta"):
        model = HFLike()
    torch.manual_seed(11)
    opt = zero.wrap(model, 3, CASES["adamw"]["optimizer"], init=model._init_weights)
    assert [m for u in opt.units for m in u.modules] == list(model.transformer.h)  # default units
    full = opt.full_state_dict()
    assert all(torch.equal(full[n], p.detach()) for n, p in ref.named_parameters())
    assert (full["transformer.h.0.c_proj.weight"].std()
            < 0.6 * full["transformer.h.0.c_attn.weight"].std())
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(model.transformer.positions, ref.transformer.positions)
    x = torch.randint(V, (2, T))
    loss = model(x).logits.float().logsumexp(-1).mean()  # a model-output object, as HF returns
    loss.backward()
    opt.step()


class HFLike(nn.Module):
    """A GPT-2-shaped model as transformers lays it out."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.c_attn, self.c_proj = (nn.LayerNorm(D), nn.Linear(D, 3 * D),
                                                   nn.Linear(D, D))

        def forward(self, h):
            q, k, v = self.c_attn(self.ln_1(h)).chunk(3, -1)
            return h + self.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))

    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
            self.h = nn.ModuleList(HFLike.Block() for _ in range(3))
            self.ln_f = nn.LayerNorm(D)
            self.register_buffer("positions", torch.arange(T), persistent=False)

    def __init__(self):
        super().__init__()
        self.transformer = HFLike.Body()
        self.lm_head = nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(0.0, 0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()
        if isinstance(module, HFLike.Block):  # over what c_proj's own init drew (apply's order)
            for name, p in module.named_parameters():
                if name == "c_proj.weight":
                    p.data.normal_(0.0, 0.02 / math.sqrt(2 * len(self.transformer.h)))
        if isinstance(module, HFLike.Body):
            module.positions.copy_(torch.arange(T))

    def forward(self, x):
        t = self.transformer
        h = t.wte(x) + t.wpe(t.positions[:x.shape[1]])
        for block in t.h:
            h = block(h)
        return types.SimpleNamespace(logits=self.lm_head(t.ln_f(h)))


def test_complex_parameter_on_the_meta_device(one_rank):
    # A complex parameter (a spectral filter's weights) built on the meta device: init= sets it as
    # a normally built model's, and one its init leaves unset is refused, as a float's is
    class Spectral(nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.head = nn.Parameter(torch.empty(D, D, dtype=torch.cfloat)), nn.Linear(D, 1)

        def forward(self, x):
            return self.head((x.to(torch.cfloat) @ self.w).abs())

    def init(m):  # (drawn from a seed of its own: the same whichever order the modules come in)
        g = torch.Generator().manual_seed(3 + isinstance(m, Spectral))
        for p in m.parameters(recurse=False):
            p.copy_(torch.randn(p.shape, dtype=p.dtype, generator=g))
    ref = Spectral()
    with torch.no_grad():
        ref.apply(init)
    with torch.device("meta"):
        model, unset = Spectral(), Spectral()
    opt = zero.wrap(model, 3, CASES["adamw"]["optimizer"], init=init)
    full = opt.full_state_dict()
    assert full["w"].dtype == torch.cfloat and full["w"].abs().min() > 0
    assert all(torch.equal(full[n], p.detach()) for n, p in ref.named_parameters())
    with pytest.raises(ValueError, match="zero: w is not initialized"):
        zero.wrap(unset, 3, CASES["adamw"]["optimizer"], init=lambda m: isinstance(m, nn.Linear)
                  and m.reset_parameters())
