"""Does sharing a subspace pay where shared matrix atoms do not? A measurement for the issue "Sharing that pays".

Every form below spends the same budget (⌊(1−ρ)·P_attn⌋ numbers) on low-rank factors, ranks chosen by the same
greedy allocation over relative whitened discarded energy (the default's `global-relative`, with matrices kept
whole where factors would cost more), on the same calibration statistics:

- `none`: per-matrix whitened factors W_l ≈ A_l B_l (what `--bases 0` does, every layer compressed);
- `basis-kv` / `basis-qkv`: for each group of `size` consecutive layers and each of k/v (or q/k/v), ONE input
  basis B (r × in) shared by the group's layers, per-layer output coefficients A_l (out × r): the stacked
  weights [W_l]_l are factored under the whitening of the group's summed autocorrelation (Basis Sharing's
  construction), then each A_l is refit on its own layer's statistics (A_l = W_l C_l Bᵀ (B C_l Bᵀ)⁻¹);
- `qkv-joint`: one input basis for Q, K and V of all the group's layers (they read the same input).

A shared basis of rank r costs r·in once plus r·out per layer, exactly the cost of a rank-r factorization of the
stacked matrix, so the allocation treats a group's stacked matrix as one matrix with |g| times the weight of a
per-layer one in the objective. The models are built with dense weights equal to the factored products (the same
function as the factored modules; the accounting above is exact), scored against the original in one pass
(validation split, where forms are chosen; `--split test` reports the chosen one), and compared with `none` by
paired bootstrap intervals.

    python -m benchmarks.sharing_forms --ratios 0.2,0.4 --out benchmarks/sharing-forms.json
    python -m benchmarks.sharing_forms --split test --only basis-kv/4 --sizes 4 --out benchmarks/sharing-forms-test.json
"""

from __future__ import annotations

import argparse
import copy
import json
import math

import torch

from benchmarks.quality import compare, prepare_quality, quality_header, score, strip_windows
from compressor.adapters import PROJECTIONS, get_adapter
from compressor.allocation import allocate_global_with_dense
from compressor.grouping import consecutive_runs
from compressor.whitening import discarded_energy, low_rank_factors, whitened_svd, whitening_factor

FORMS = {"none": (), "basis-kv": ("k_proj", "v_proj"), "basis-qkv": ("q_proj", "k_proj", "v_proj")}


def _matrices(adapter, stats, shared: tuple[str, ...], size: int, joint: bool) -> list[dict]:
    """The matrices the allocation sees: per-layer ones, and one stacked matrix per group and shared type."""
    n, out = adapter.num_layers, []
    groups = consecutive_runs(n, size)
    weight = {
        (i, p): adapter.projection(i, p).weight.detach().double() for i in range(n) for p in PROJECTIONS
    }
    for layer in range(n):
        for p in PROJECTIONS:
            if p not in shared or size == 1:
                out.append({"layers": [layer], "types": [p]})
    if size > 1 and shared:
        for g in groups:
            if joint:
                out.append({"layers": g, "types": list(shared)})
            else:
                out += [{"layers": g, "types": [p]} for p in shared]
    for m in out:
        m["blocks"] = [(i, p) for i in m["layers"] for p in m["types"]]
        m["heights"] = [weight[b].shape[0] for b in m["blocks"]]
        m["W"] = torch.cat([weight[b] for b in m["blocks"]])  # stacked (Σ out, in)
        kind = "attn" if m["types"][0] != "o_proj" else "o"
        m["C_each"] = {i: stats.autocorr(kind, i) for i in m["layers"]}
        m["S"] = whitening_factor(sum(m["C_each"].values())).S
        u, sigma, vh = whitened_svd(m["W"], m["S"])
        m["svd"] = (u, sigma, vh)
        energy = float((sigma**2).sum()) or 1.0
        # relative error, weighted by the number of matrices the stacked one stands for
        m["tail"] = discarded_energy(sigma) * len(m["blocks"]) / energy
        m["shape"] = (m["W"].shape[0], m["W"].shape[1])
    return out


def _allocate(matrices: list[dict], budget: int) -> None:
    names = {str(i): m for i, m in enumerate(matrices)}
    ranks, dense = allocate_global_with_dense(
        {k: m["tail"] for k, m in names.items()},
        {k: m["shape"] for k, m in names.items()},
        budget,
        {k: m["shape"][0] * m["shape"][1] for k, m in names.items()},
    )
    for k, m in names.items():
        m["rank"], m["dense"] = (None, True) if k in dense else (ranks[k], False)


def _approximations(m: dict) -> dict[tuple[int, str], torch.Tensor]:
    """Each block's approximation: the stacked factors, with per-layer coefficients refit on its statistics."""
    blocks = dict(zip(m["blocks"], torch.split(m["W"], m["heights"]), strict=True))
    if m["dense"]:
        return blocks
    u, sigma, vh = m["svd"]
    a, b = low_rank_factors(u, sigma, vh, m["S"], m["rank"])
    approx, row = {}, 0
    for (layer, p), w in blocks.items():
        if len(m["layers"]) > 1 and m["rank"] > 0:
            # coefficients refit on the layer's own statistics: argmin_A ‖(W − A B) S_l‖
            c = m["C_each"][layer]
            approx[(layer, p)] = torch.linalg.solve(b @ c @ b.T, b @ c @ w.T).T @ b
        else:
            approx[(layer, p)] = a[row : row + w.shape[0]] @ b
        row += w.shape[0]
    return approx


def build(
    setup, shared: tuple[str, ...], size: int, joint: bool, ratio: float
) -> tuple[torch.nn.Module, dict]:
    model = copy.deepcopy(setup.loaded.model)
    adapter = get_adapter(model)
    stats = setup.stats
    matrices = _matrices(adapter, stats, shared, size, joint)
    before = adapter.target_parameter_count()
    budget = math.floor((1 - ratio) * before)
    _allocate(matrices, budget)
    stored, error, energy = 0, 0.0, 0.0
    with torch.no_grad():
        for m in matrices:
            stored += m["shape"][0] * m["shape"][1] if m["dense"] else m["rank"] * sum(m["shape"])
            for (layer, p), w_hat in _approximations(m).items():
                module = adapter.projection(layer, p)
                w = module.weight.detach().double()
                c = stats.autocorr("o" if p == "o_proj" else "attn", layer)
                error += float(torch.trace((w - w_hat) @ c @ (w - w_hat).T))
                energy += float(torch.trace(w @ c @ w.T))
                module.weight.copy_(w_hat.to(module.weight.dtype))
    assert stored <= budget, (stored, budget)
    info = {"stored": stored, "budget": budget, "achieved_ratio": 1 - stored / before,
            "relative_whitened_error": error / energy,
            "kept_whole": sum(1 for m in matrices if m["dense"])}  # fmt: skip
    return model, info


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ratios", default="0.2,0.4")
    parser.add_argument("--sizes", default="2,4")
    parser.add_argument("--only", help="comma-separated forms to build (default: all; `none` always)")
    parser.add_argument(
        "--split", default="validation", help="choose on validation; report the choice on test"
    )
    parser.add_argument("--eval-max-tokens", type=int, default=None)
    parser.add_argument("--out", default="benchmarks/sharing-forms.json")
    args = parser.parse_args(argv)
    setup = prepare_quality("smollm2-135m", split=args.split, evaluate_original=False,
                            eval_max_tokens=args.eval_max_tokens)  # fmt: skip
    variants = [("none", (), 1, False)]
    for size in (int(s) for s in args.sizes.split(",")):
        variants += [(f"basis-kv/{size}", FORMS["basis-kv"], size, False),
                     (f"basis-qkv/{size}", FORMS["basis-qkv"], size, False),
                     (f"qkv-joint/{size}", FORMS["basis-qkv"], size, True)]  # fmt: skip
    if args.only:
        wanted = {"none", *args.only.split(",")}
        variants = [v for v in variants if v[0] in wanted]
    result = {"header": quality_header(setup), "split": args.split, "ratios": {}}
    for ratio in (float(r) for r in args.ratios.split(",")):
        models, infos = {}, {}
        for name, shared, size, joint in variants:
            models[name], infos[name] = build(setup, shared, size, joint, ratio)
            print(f"{ratio} {name}: {infos[name]}", flush=True)
        scores = score(setup, models, setup.evaluation)
        rows = {}
        for name in models:
            rows[name] = {**infos[name], **strip_windows(scores)["models"][name]}
            rise_none = scores["models"]["none"]["ppl"] - scores["original"]["ppl"]
            if name != "none":
                rows[name]["vs_none"] = compare(scores, name, "none")
                rows[name]["share_of_rise"] = rows[name]["vs_none"]["value"] / rise_none
            print(f"{ratio} {name}: ppl {rows[name]['ppl']:.3f} {rows[name].get('vs_none', '')}", flush=True)
        result["ratios"][str(ratio)] = {"original_ppl": scores["original"]["ppl"], "rows": rows}
        del models
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
