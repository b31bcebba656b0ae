#!/usr/bin/env python3
"""Predicted (ft plan) against measured (metrics.jsonl) memory of real CPU runs.

For each case: `ft plan --json` and a real `ft train` (world size 1) or `ft launch --standalone`
(world size W), a few steps of a medium model; compares per rank the model-state bytes (exact) and
the peak resident memory of the training steps (VmHWM) with the plan's step peak.

    python3 bench/plan_accuracy.py [--ft build/bin/ft] [--quick] [--json out.json] [--extra K=V ...]
"""
import argparse, itertools, json, os, subprocess, sys, tempfile, time

MODEL = ["model.vocab_size=8000", "model.hidden_size=512", "model.intermediate_size=1408",
         "model.num_layers=4", "model.num_heads=8", "model.num_kv_heads=4",
         "model.tie_embeddings=false", "data.seq_len=256", "train.micro_batch=4",
         "train.max_steps=3", "train.log_every=1", "hardware.device=cpu"]

STRATEGIES = {
    "ddp": ["strategy.kind=ddp"],
    "zero3": ["strategy.kind=zero3"],
    "fsdp-full": ["strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=FULL_SHARD"],
    "fsdp-grad-op": ["strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=SHARD_GRAD_OP"],
    "fsdp-no-shard": ["strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=NO_SHARD"],
}


def case_sets(strategy, lora, precision, ac):
    sets = MODEL + STRATEGIES[strategy] + [f"precision.mode={precision}",
                                           f"train.activation_checkpointing={'full' if ac else 'none'}"]
    if lora:
        sets += ["lora.enabled=true", "lora.r=16", "lora.dropout=0.0"]
    return sets


def run_case(ft, world, sets, workdir):
    args = sum([["--set", s] for s in sets], [])
    plan = json.loads(subprocess.run([ft, "plan", "--preset", "tiny-demo", "--nproc-per-node", str(world)]
                                     + args + ["--json"], capture_output=True, text=True).stdout)
    out = os.path.join(workdir, "run")
    if world == 1:
        cmd = [ft, "train", "--preset", "tiny-demo", "--output", out] + args
    else:
        cmd = [ft, "launch", "--standalone", "--nproc-per-node", str(world), "--preset", "tiny-demo",
               "--output", out] + args
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    ranks = []
    for rank in range(world):
        path = os.path.join(out, "metrics.jsonl" if world == 1 else f"metrics.rank{rank}.jsonl")
        lines = [json.loads(l) for l in open(path)]
        mem = lines[-1]["memory"]
        ranks.append({"param_bytes": mem["param_bytes"], "grad_bytes": mem["grad_bytes"],
                      "optimizer_bytes": mem["optimizer_bytes"],
                      "peak_rss_bytes": max(l["memory"]["peak_rss_bytes"] for l in lines)})
    return plan, ranks, time.time() - t0


def plan_of(ft, world, sets):
    args = sum([["--set", s] for s in sets], [])
    return json.loads(subprocess.run([ft, "plan", "--preset", "tiny-demo", "--nproc-per-node",
                                      str(world)] + args + ["--json"],
                                     capture_output=True, text=True).stdout)


def print_row(row):
    print(f"{row['world']:>2} {row['strategy']:<14} {str(row['lora']):<5} {row['precision']:<5} "
          f"{str(row['activation_checkpointing']):<5} {'exact' if row['state_exact'] else 'DIFF':<6} "
          f"{row['predicted']/2**20:9.1f} {row['measured']/2**20:9.1f} {row['error']*100:6.1f}%",
          flush=True)


def replan(a):
    rows, worst = json.load(open(a.replan)), 0.0
    for row in rows:
        sets = case_sets(row["strategy"], row["lora"], row["precision"],
                         row["activation_checkpointing"]) + row.get("extra", [])
        r = plan_of(a.ft, row["world"], sets)["rank"]
        row["state_exact"] = all(k[key] == r[key] for k in row["ranks"]
                                 for key in ("param_bytes", "grad_bytes", "optimizer_bytes"))
        row["predicted"] = r["step_peak_bytes"]
        row["error"] = (row["predicted"] - row["measured"]) / row["measured"]
        worst = max(worst, abs(row["error"]))
        print_row(row)
    print(f"worst |error| {worst*100:.1f}% over {len(rows)} cases")
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ft", default="build/bin/ft")
    ap.add_argument("--quick", action="store_true", help="one case per dimension value")
    ap.add_argument("--json")
    ap.add_argument("--bf16-max-world", type=int, default=4,
                    help="bf16 runs only up to this world size (bf16 matmuls are slow on CPU)")
    ap.add_argument("--precision", choices=["fp32", "bf16"], help="only this precision")
    ap.add_argument("--worlds", default="1,2,4", help="world sizes to run, e.g. 2,4")
    ap.add_argument("--sample", type=int, default=1,
                    help="run one case in N of the selected ones (after the filters)")
    ap.add_argument("--extra", action="append", default=[], metavar="KEY=VALUE",
                    help="a --set added to every case after the matrix's own (another model shape, "
                         "to check the plan out of the sample it was calibrated on); repeatable")
    ap.add_argument("--replan", metavar="JSON",
                    help="re-plan the measured runs of an earlier --json with this ft's plan (the "
                         "measurements are kept; only the prediction changes)")
    a = ap.parse_args()
    if a.replan:
        return replan(a)
    worlds = [int(w) for w in a.worlds.split(",")]
    cases = []
    for world, strategy, lora, precision, ac in itertools.product(
            [1, 2, 4], STRATEGIES, [False, True], ["fp32", "bf16"], [False, True]):
        if world == 1 and strategy != "ddp":
            continue  # every strategy is the single-rank engine at world size 1
        if precision == "bf16" and world > a.bf16_max_world:
            continue
        if world not in worlds or (a.precision and precision != a.precision):
            continue
        cases.append((world, strategy, lora, precision, ac))
    if a.quick:
        cases = [c for i, c in enumerate(cases) if i % 7 == 0]
    cases = cases[::a.sample]
    rows, worst = [], 0.0
    print(f"{'W':>2} {'strategy':<14} {'lora':<5} {'prec':<5} {'ac':<5} {'state':<6} "
          f"{'pred MiB':>9} {'meas MiB':>9} {'err':>7}")
    for world, strategy, lora, precision, ac in cases:
        with tempfile.TemporaryDirectory() as d:
            plan, ranks, secs = run_case(a.ft, world,
                                         case_sets(strategy, lora, precision, ac) + a.extra, d)
        r = plan["rank"]
        exact = all(k[r_key] == r[r_key] for k in ranks
                    for r_key in ("param_bytes", "grad_bytes", "optimizer_bytes"))
        meas = max(k["peak_rss_bytes"] for k in ranks)
        pred = r["step_peak_bytes"]
        err = (pred - meas) / meas
        worst = max(worst, abs(err))
        rows.append({"world": world, "strategy": strategy, "lora": lora, "precision": precision,
                     "extra": a.extra,
                     "activation_checkpointing": ac, "state_exact": exact, "predicted": pred,
                     "measured": meas, "error": err, "ranks": ranks, "seconds": secs})
        print(f"{world:>2} {strategy:<14} {str(lora):<5} {precision:<5} {str(ac):<5} "
              f"{'exact' if exact else 'DIFF':<6} {pred/2**20:9.1f} {meas/2**20:9.1f} {err*100:6.1f}%",
              flush=True)
    print(f"worst |error| {worst*100:.1f}% over {len(rows)} cases")
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
