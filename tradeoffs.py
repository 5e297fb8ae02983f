"""
tradeoffs.py: which stage for which model and cluster: what each stage costs in memory and in
bytes sent, from the ZeRO paper's formulas (arXiv:1910.02054).

    python zero.py --estimate --params 7.5e9 --world-size 64     # the paper's Figure 1

What it is: --estimate, the model-state memory of every stage and the elements each rank sends,
from the formulas alone: no model, no ranks.

What it uses of zero.py: the formulas (memory_formula, comm_formula) and STAGE_NAMES. zero.py
imports this file at the flag that needs it.
"""
from zero import STAGE_NAMES, comm_formula, memory_formula


def estimate(psi, world, shard_size=None, stages=range(4)):
    """Per-rank model-state memory for each stage (or those in `stages`), from the formula
    alone: no model, no ranks; and the elements each rank sends per step, inside its group of G
    and across the groups."""
    G = shard_size or world
    print(f"ZeRO model-state memory per rank (formula: the ZeRO paper, arXiv:1910.02054, "
          f"Figure 1)\nΨ = {psi:.4g} parameters, N = {world} ranks"
          + (f" in groups of G = {G} (hybrid: stages 1-3 shard over G)" if G < world else "")
          + ",\nmixed-precision Adam: 2 + 2 + 12 bytes per parameter, GB = 1e9 bytes\n\n"
          f"{'stage':<27} {'params':>9} {'grads':>9} {'optimizer':>9} {'total':>9}  "
          f"{'sent, in group':>14} {'across groups':>14}")
    for stage in stages:
        m = {k: v / 1e9 for k, v in memory_formula(stage, psi, world, 2, 2, 12, G).items()}
        sent = comm_formula(stage, psi, world, 1, 1, shard_size=G)
        across = sent.pop("all_reduce across groups", 0)
        inside = sum(sent.values()) if stage or G == world else 0  # stage 0: all-reduce over N
        across += 0 if stage or G == world else sum(sent.values())
        gb = [_fit(m[k], 2) for k in ("params", "grads", "optimizer")] + [_fit(sum(m.values()), 1)]
        print(f"{stage} {STAGE_NAMES[stage].split(':')[0]:<25} "
              + " ".join(f"{x:>6} GB" for x in gb) + f"  {inside:>14.4g} {across:>14.4g}")
    ring = "2Ψ(N-1)/N for stages 0-2, 3Ψ(N-1)/N for stage 3" if len(stages) == 4 else \
        ", ".join(f"{3 if s == 3 else 2}Ψ(N-1)/N for stage {s}" for s in stages)
    print(f"\nsent: elements per rank per step (ring algorithms): {ring}" + (
        ";\nwith G < N the reduce-scatters and all-gathers run inside a group of G, and each "
        "shard's all-reduce\ncrosses the groups (stage 0's all-reduce runs over all N)"
        if G < world else ""))


def _fit(x, decimals, width=6):
    """x with `decimals` decimals, or in fewer significant digits where that is wider than
    `width` (Ψ = 1e30): the table's columns hold."""
    text = f"{x:.{decimals}f}"
    for digits in (3, 2, 1):
        text = text if len(text) <= width else f"{x:.{digits}g}"
    return text if len(text) <= width else f"{x:.0e}"
