"""
meta_init.py: building a model that no rank can hold whole, from the meta device.

    with torch.device("meta"):
        model = GPT(...)                                         # shapes only, no memory
    opt = zero.wrap(model, 3, optimizer, init=GPT.init_weights)  # unit by unit, sharded

Under `with torch.device("meta"):` a model
is built with shapes and dtypes only, no memory and no initialization (PyTorch's way to build
what does not fit; FSDP2 shards such a model and then calls to_empty() and an init, DeepSpeed
builds under zero.Init). wrap() then visits the modules in the order of model.apply(init),
torch's and transformers' way to initialize (children first, then their parent, whose init
may set its children's tensors: GPT-2's scaled init of the residual projections), and
allocates a unit only when the walk first reaches a module holding one of its parameters. A
unit is handed back to wrap() to be broadcast and cut to this rank's shard (stage 3 frees
the rest) once its own module, and every module holding one of its parameters, is
initialized; only then is the next unit allocated. So at stage 3 a rank holds its shards,
the root unit (handed out last: the model's own init may set any of it) and the one unit
being initialized, never the whole model. (A unit with a parameter that a later module
shares, such as an embedding unit tied to a head unit, stays whole until that module is
initialized: its init draws that parameter again.) The random numbers are drawn in the same
order as by model.apply(init) on a normally built model after the same torch.manual_seed:
the same weights, bit for bit. An init that writes where that cannot hold (to a unit not
allocated yet, whose meta tensors would silently drop the write, or one already cut) is an
error (_NoWritesOutside).

What it uses of zero.py: the units (unit.flat, offset, my_slice, shard, master) and the
Meter; zero.materialize() hands a model built on the meta device to materialize() here.
"""
import torch
import torch.distributed as dist


def materialize(zero, init):
    """The units of a model built on the meta device, each ready to be sharded (wrap's loop):
    each unit is allocated and initialized just before it is handed out: init(m) for every
    module m in model.apply()'s order (default: m.reset_parameters(), where m has one; a module
    with tensors of its own on the meta device and no reset_parameters is an error). Every
    element starts as NaN, so one that init() leaves unset is an error, not garbage. The init
    runs on the CPU, whose random numbers are the same whatever the device: a model built on
    a GPU gets the weights it gets on the CPU; each unit then moves to zero.device."""
    model, names = zero.model, {m: n or "the model" for n, m in zero.model.named_modules()}
    modules, tnames = [], {t: n for n, t in [*model.named_parameters(), *model.named_buffers()]}
    model.apply(modules.append)  # nn.Module.apply's own order: children first, then their parent
    owner = {p: u for u in zero.units for p in u.params}
    # last: the unit -> the last module holding one of its parameters or its own module (the
    # root unit's: the model), whose init may set its children's (k grows: the last one stays)
    last = {u: k for k, m in enumerate(modules)
            for u in [owner[p] for p in m.parameters(recurse=False) if p in owner]
            + [u for u in zero.units if m in (u.modules or [model])]}
    # was_meta: the ids of the tensors built on the meta device (real once made here: a unit's
    # parameters when it is allocated, a frozen parameter or a buffer at its first module)
    was_meta = {id(t) for t in [*model.parameters(), *model.buffers()] if t.is_meta}
    # fresh: the frozen parameters and buffers made here; released: the storages of the units
    # handed out
    fresh, released = [], []
    for k, m in enumerate(modules):
        own = [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        if init is None and not hasattr(m, "reset_parameters") and any(
                id(t) in was_meta for t in own):
            raise ValueError(f"zero: {names[m]} ({type(m).__name__}) has tensors on the meta "
                             "device and no reset_parameters(): initialize it by wrap(init=...)")
        for t in own:
            if t in owner and (u := owner[t]).flat.is_meta:  # its unit, allocated on the CPU:
                u.flat = torch.zeros(u.flat.numel(), dtype=u.flat.dtype, device="cpu")
                for p in u.params:  # each parameter becomes a view of the flat buffer, as in Unit()
                    _swap_in(p, _unset(u.view(u.flat, p)))
                zero.meter.event("materialized", u)
            # a frozen parameter or a buffer (made once where two modules share it): not sharded,
            # held whole as in a normal build
            elif t.is_meta:
                _swap_in(t, _unset(torch.empty_like(t, device="cpu")))
                fresh.append((t, tnames[t]))
            elif id(t) not in was_meta and t.device != zero.device:  # a buffer built off meta
                t.data = t.data.to(zero.device)
        before = list(map(id, m.parameters(recurse=False)))  # (ids: == on tensors is per element)
        with torch.no_grad(), _NoWritesOutside(names[m], released):
            if init is not None:
                init(m)
            elif hasattr(m, "reset_parameters"):
                m.reset_parameters()
        if list(map(id, m.parameters(recurse=False))) != before:
            raise ValueError(f"zero: init() replaced a parameter of {names[m]}: initialize "
                             "the module's parameters in place (torch.nn.init, copy_)")
        for u in [u for u, at in last.items() if at == k]:
            _check_set([(p, tnames[p]) for p in u.params])
            u.flat = u.flat.to(zero.device)  # (the CPU: the same tensor)
            for p in u.params:
                p.data = u.view(u.flat, p)
            u.shard = u.master = u.flat[u.my_slice]
            yield u
            released.append(u.flat.untyped_storage())
    _check_set(fresh)
    for t, _ in fresh:  # frozen parameters and buffers, initialized on the CPU too
        t.data = t.data.to(zero.device)


def build_device(device):
    """Where a model built on the meta device is built: `device` (wrap(device=...)), by default
    this rank's GPU under NCCL, else the CPU."""
    device = torch.device(device or ("cuda" if dist.get_backend() == "nccl" else "cpu"))
    gpus = torch.cuda.device_count()
    if device.type != "cpu" and not (device.type == "cuda" and (device.index or 0) < gpus):
        raise ValueError(f"zero: device={str(device)!r}: build on cpu, or on a CUDA GPU it sees")
    # "cuda" without an index: this rank's current GPU
    return torch.device("cuda", torch.cuda.current_device()) if str(device) == "cuda" else device


class _NoWritesOutside(torch.overrides.TorchFunctionMode):
    """init(m) may write only to tensors that exist now: not to those of a unit not allocated yet
    (a meta tensor: the write would be silently dropped) nor of one already handed out. A torch
    function mode sees every torch call made inside it; in-place ones end in "_"."""

    def __init__(self, module_name, released):
        super().__init__()
        self.module_name, self.released = module_name, released

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if (name.endswith("_") and not name.startswith("_")) or "out" in kwargs:
            for t in [args[0] if args else kwargs.get("tensor"), kwargs.get("out")]:
                if torch.is_tensor(t) and t.numel() and (t.is_meta or any(
                        t.untyped_storage()._cdata == s._cdata for s in self.released)):
                    when = "not allocated yet" if t.is_meta else "built already"
                    raise ValueError(f"zero: init({self.module_name}) writes to a tensor of a unit "
                                     f"that is {when} ({name}): init(module) may set the tensors "
                                     "of the module and its submodules, within one unit")
        return func(*args, **kwargs)


def _swap_in(t, value):
    # A meta tensor's .data cannot be set to a real one (another tensor type), and replacing the
    # Parameter object would break ties (one parameter in two modules) and references held
    # elsewhere. torch.utils.swap_tensors swaps the two objects' contents instead: `t` stays the
    # same Python object; then .data points it at `value` (a view into the unit's flat buffer),
    # as Unit() does. (Made from `value` itself, it would share its version counter with the
    # flat buffer, and stage 3's gathers would then look to autograd like in-place changes.)
    new = torch.Tensor._make_subclass(type(t), value.new_empty(0), t.requires_grad)
    new.__dict__.update(t.__dict__)
    torch.utils.swap_tensors(t, new)
    t.data = value


def _unset(t):  # what no init has written yet: NaN (or the smallest integer)
    return t.fill_(float("nan") if t.is_floating_point() or t.is_complex() else
                   torch.iinfo(t.dtype).min if t.dtype != torch.bool else False)


def _check_set(tensors):
    # unset: _unset's value left, anywhere in a float or complex tensor, everywhere in another
    for t, name in tensors:
        if torch.isnan(t).any() if t.is_floating_point() or t.is_complex() else \
                t.numel() > 0 and t.dtype != torch.bool and (t == torch.iinfo(t.dtype).min).all():
            raise ValueError(f"zero: {name} is not initialized: init(module) must set every "
                             "parameter and buffer of the module it is given")


