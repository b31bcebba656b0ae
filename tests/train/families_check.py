"""transformers and PEFT load what ft writes for every model family ft trains, and compute its loss.

For each family (llama, mistral, ministral, qwen2, qwen3, gemma2, gemma3_text, phi3, olmo2, granite,
and the mixture-of-experts mixtral and qwen3_moe)
it builds a tiny random model with transformers (save_pretrained) in a temporary directory, with
the llama3 fixture tokenizer beside it. Each is configured as its fixture in tests/model/fixtures/
is (FAMILIES.md), so that the family's features are active on the evaluation records: windows of 8
tokens (records are 10 to 40), Gemma 2's soft caps, Phi-3's partial rotary with longrope past its
original_max_position_embeddings, Gemma 3's local and global rotary, Granite's multipliers, tied
and untied heads, GQA; every norm weight and bias random. Then, per family:

  1. base: `ft eval --model BASE` equals transformers' loss on the same records;
  2. LoRA: `ft train --preset tiny-lora --model BASE` for 3 steps (MoE families: the experts too,
     lora.target_parameters, and the routers, lora.train_router); PeftModel.from_pretrained(BASE,
     final/) loads the adapter and its loss equals `ft eval --model BASE --adapter final/`'s, and
     transformers' loss of the `ft export --merge-lora` model equals PEFT's;
  3. full: `ft train --model BASE` for 3 fp32 steps, `ft export` of the run; transformers loads the
     export (and final/) with no missing, unexpected or mismatched key, the export holds the base's
     tensor names (no lm_head where tied) and its config.json is the base's, and its loss equals
     `ft eval --model EXPORT`'s;
  4. PEFT-written adapter: get_peft_model on the base (every projection, fused ones for Phi-3, lora_B
     random; every other family target_modules="all-linear", which PEFT saves as full module paths,
     with rsLoRA; MoE families the attention, the fused experts (target_parameters) and the routers
     (modules_to_save ["gate"])),
     save_pretrained; `ft eval --model BASE --adapter THAT` equals PEFT's loss.

Losses are the mean next-token loss over pre-tokenized records (both sides see the same ids),
within 1e-4 relative; each trained model must move the loss by more than 10x that, so a file that
loads but is ignored fails. transformers runs eager attention (SDPA drops Gemma 2's soft cap).
Exit status: 0 pass, 1 mismatch or failure, 77 skipped (this Python lacks transformers or peft;
CTest's SKIP_RETURN_CODE; a failure under CI=true).

    $FT_PYTHON tests/train/families_check.py --ft build/bin/ft [--families qwen3,phi3] [--keep DIR]
"""
import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
WINDOW = 8   # shorter than every evaluation record and than the training seq_len
SEQ_LEN = 64
STEPS = 3

sys.path.insert(0, HERE)
# interop_check's import exits with 77 (skipped), or 1 under CI=true, when this Python lacks
# transformers or peft; the rest below comes with them.
from interop_check import RTOL, TOKENIZER, hf_loss  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from safetensors import safe_open  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import (AutoConfig, AutoModelForCausalLM, Gemma2Config,  # noqa: E402
                          Gemma3TextConfig, GraniteConfig, LlamaConfig, MinistralConfig,
                          MistralConfig, MixtralConfig, Olmo2Config, Phi3Config, Qwen2Config,
                          Qwen3Config, Qwen3MoeConfig)
sys.path.insert(0, os.path.join(HERE, "..", "model", "fixtures"))
from make_family_fixtures import randomise_norms_and_biases  # noqa: E402

# The fixture tokenizer has 1150 ids. Init 0.2 (the fixtures: 0.1 over 96 ids) makes attention scores
# and hidden states large enough that every ABLATIONS switch moves the loss over 1150 ids by > 5e-4.
SIZES = dict(vocab_size=1152, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             max_position_embeddings=128, rms_norm_eps=1e-5, initializer_range=0.2)
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PHI3_PROJECTIONS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
GQA = dict(num_attention_heads=4, num_key_value_heads=2)

# family: (config class, config kwargs, PEFT target modules); seeds follow the order.
FAMILIES = {
    "llama": (LlamaConfig, dict(GQA, tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}), PROJECTIONS),
    "mistral": (MistralConfig, dict(GQA, tie_word_embeddings=False, sliding_window=WINDOW,
                                    rope_parameters={"rope_type": "default",
                                                     "rope_theta": 1000000.0}), PROJECTIONS),
    "ministral": (MinistralConfig, dict(
        GQA, num_hidden_layers=3, head_dim=8, tie_word_embeddings=False, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), PROJECTIONS),
    "qwen2": (Qwen2Config, dict(
        GQA, num_hidden_layers=3, tie_word_embeddings=True, use_sliding_window=True,
        sliding_window=WINDOW, max_window_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), PROJECTIONS),
    "qwen3": (Qwen3Config, dict(GQA, head_dim=16, tie_word_embeddings=False, rope_parameters={
        "rope_type": "default", "rope_theta": 1000000.0}), PROJECTIONS),
    "gemma2": (Gemma2Config, dict(
        GQA, head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=0.5,
        final_logit_softcapping=1.5, sliding_window=WINDOW, hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), PROJECTIONS),
    "gemma3_text": (Gemma3TextConfig, dict(
        GQA, num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
        sliding_window_pattern=3, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}),
        PROJECTIONS),
    # Records of 10+ tokens are past original_max_position_embeddings 8: the long factors.
    "phi3": (Phi3Config, dict(
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
        original_max_position_embeddings=8, pad_token_id=95, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.75,
                         "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                         "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 24.0]}), PHI3_PROJECTIONS),
    "olmo2": (Olmo2Config, dict(GQA, tie_word_embeddings=False, eos_token_id=2, rope_parameters={
        "rope_type": "default", "rope_theta": 500000.0}), PROJECTIONS),
    "granite": (GraniteConfig, dict(
        GQA, tie_word_embeddings=False, attention_bias=True, embedding_multiplier=12.0,
        residual_multiplier=0.22, attention_multiplier=0.5, logits_scaling=0.5, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), PROJECTIONS),
    # Mixture-of-experts (issue 31): 4 experts top 2 in both layers; the aux loss on (it is not in
    # the evaluated loss, but training with it moves the router). LoRA adapts the attention by
    # name and the fused experts through target_parameters (EXPERT_PARAMETERS), in ft and PEFT.
    "mixtral": (MixtralConfig, dict(GQA, num_local_experts=4, num_experts_per_tok=2,
                                    output_router_logits=True, router_aux_loss_coef=0.02,
                                    tie_word_embeddings=False),
                ["q_proj", "k_proj", "v_proj", "o_proj"]),
    # Layer 1 is MoE (8 experts top 2, not renormalised), layer 0 a dense MLP (mlp_only_layers).
    "qwen3_moe": (Qwen3MoeConfig, dict(GQA, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                       moe_intermediate_size=24, mlp_only_layers=[0],
                                       output_router_logits=True, router_aux_loss_coef=0.02,
                                       tie_word_embeddings=False, rope_parameters={
                                           "rope_type": "default", "rope_theta": 1000000.0}),
                  ["q_proj", "k_proj", "v_proj", "o_proj"]),
}
# Switches that turn each family's distinguishing features off: on the evaluation records each must
# move transformers' loss by more than 5x the tolerance, so that an ft without that feature fails.
ABLATIONS = {
    "mistral": [{"sliding_window": None}],
    "ministral": [{"layer_types": ["full_attention"] * 3}],
    "qwen2": [{"layer_types": ["full_attention"] * 3}],
    "gemma2": [{"attn_logit_softcapping": None}, {"final_logit_softcapping": None},
               {"layer_types": ["full_attention"] * 2}],
    "gemma3_text": [{"layer_types": ["full_attention"] * 4},
                    {"layer_types": ["sliding_attention"] * 4, "sliding_window": 128}],
    "phi3": [{"original_max_position_embeddings": 128}],
    "mixtral": [{"num_experts_per_tok": 1}],
    "qwen3_moe": [{"norm_topk_prob": True}, {"num_experts_per_tok": 1}],
    "granite": [{"logits_scaling": 1.0}, {"residual_multiplier": 1.0},
                {"attention_multiplier": 0.125}, {"embedding_multiplier": 1.0}],
}
# The models are tiny: a second thread only waits for the first, and costs seconds per command when
# ctest runs other tests beside this one.
ONE_THREAD = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
# config.json keys that may differ between the base and ft's export.
CONFIG_NOISE = {"transformers_version", "dtype", "torch_dtype", "_name_or_path", "architectures"}


def run(argv, log):
    """Runs argv with its output in `log`; on failure prints the log and raises."""
    with open(log, "w") as out:
        rc = subprocess.call(argv, stdout=out, stderr=subprocess.STDOUT,
                             env={**os.environ, **ONE_THREAD, "WORLD_SIZE": "1", "RANK": "0"})
    text = open(log).read()
    if rc != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {rc}:\n{text}")
    return text


class Family:
    """One family's directory and the checks on it; `ok` goes false at the first mismatch."""

    def __init__(self, ft, work, name, seed):
        self.ft, self.name, self.seed, self.ok = ft, name, seed, True
        self.dir = os.path.join(work, name)
        os.makedirs(self.dir, exist_ok=True)
        self.base = os.path.join(self.dir, "base")
        self.notes = []

    def fail(self, what):
        print(f"FAIL {self.name}: {what}")
        self.ok = False

    def ft_eval(self, model, eval_path, adapter=None):
        argv = [self.ft, "eval", "--model", model, "--data", eval_path, "--tokenizer", TOKENIZER,
                "--set", "data.format=tokenized", "--set", f"data.seq_len={SEQ_LEN}"]
        if adapter:
            argv += ["--adapter", adapter]
        name = os.path.relpath(adapter or model, self.dir).replace(os.sep, "-")
        text = run(argv, os.path.join(self.dir, f"eval-{name}.log"))
        return json.loads(text.strip().splitlines()[-1])

    def compare(self, what, ft_result, hf, ref="ft eval"):
        """`ref`'s {"loss", "tokens"} (ft eval's) against transformers' (loss, tokens)."""
        loss, tokens = hf
        rel = abs(ft_result["loss"] - loss) / abs(loss)
        ok = rel <= RTOL and ft_result["tokens"] == tokens
        line = (f"{what}: {ref} {ft_result['loss']:.8f} over {ft_result['tokens']} tokens, "
                f"transformers {loss:.8f} over {tokens} (rel {rel:.1e})")
        if ok:
            self.notes.append(f"{what} {rel:.0e}")
        else:
            self.fail(line)
        return ok

    def moved(self, what, base_loss, loss):
        """A trained model's loss is more than 10x the tolerance from the base's."""
        rel = abs(loss - base_loss) / abs(base_loss)
        if rel <= 10 * RTOL:
            self.fail(f"{what}: loss {loss:.8f} is within 10x the tolerance of the base's "
                      f"{base_loss:.8f}: were the trained weights loaded?")

    def check_loading(self, what, info):
        bad = {k: v for k, v in info.items()
               if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")}
        if bad:
            self.fail(f"{what}: transformers reports {bad}")


def hf_model(path, **kw):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation="eager", **kw)


def write_data(work):
    """A text JSONL to train on and pre-tokenized evaluation records (10 to 40 tokens each)."""
    train_path = os.path.join(work, "train.jsonl")
    with open(train_path, "w") as f:
        for i in range(16):
            f.write(json.dumps({"text": f"Record {i}: {i} plus {i} is {2 * i}, and so on."}) + "\n")
    tok = Tokenizer.from_file(TOKENIZER)
    records = [tok.encode(f"Record {i}: {i} plus {i} is {2 * i}, and so on.").ids
               for i in (3, 11)]
    gen = torch.Generator().manual_seed(5)
    records += [torch.randint(4, 1100, (int(n),), generator=gen).tolist()
                for n in torch.randint(10, 40, (3,), generator=gen)]
    assert all(len(r) >= 10 for r in records), [len(r) for r in records]
    eval_path = os.path.join(work, "eval.jsonl")
    with open(eval_path, "w") as f:
        for ids in records:
            f.write(json.dumps({"input_ids": ids}) + "\n")
    return train_path, eval_path, records


def build_base(fam):
    config_cls, extra, _ = FAMILIES[fam.name]
    torch.manual_seed(fam.seed)
    config = config_cls(**dict(SIZES, **extra))
    model = AutoModelForCausalLM.from_config(config).float().eval()
    randomise_norms_and_biases(model)
    model.save_pretrained(fam.base, safe_serialization=True)
    shutil.copy(TOKENIZER, os.path.join(fam.base, "tokenizer.json"))


def train(fam, kind, train_path, extra):
    out = os.path.join(fam.dir, kind)
    run([fam.ft, "train", "--preset", "tiny-lora" if kind == "lora" else "tiny-demo",
         "--model", fam.base, "--output", out, "--data", train_path,
         "--set", "data.format=text", "--set", "data.template=none",
         "--set", f"data.seq_len={SEQ_LEN}", "--set", "precision.mode=fp32",
         "--set", f"train.max_steps={STEPS}", "--set", "train.warmup_steps=1",
         "--set", "train.micro_batch=2", "--set", "train.lr=1e-2",
         "--set", f"output.save_every={STEPS}"] + extra,
        os.path.join(fam.dir, f"train-{kind}.log"))
    return out


def check_features_live(fam, records, base_loss):
    """Each ABLATIONS switch moves transformers' loss on the records by more than 5x RTOL."""
    moves = []
    for overrides in ABLATIONS.get(fam.name, []):
        config = AutoConfig.from_pretrained(fam.base)
        for key, value in overrides.items():
            setattr(config, key, value)
        loss = hf_loss(hf_model(fam.base, config=config).eval(), records)[0]
        moves.append(abs(loss - base_loss) / base_loss)
        if moves[-1] <= 5 * RTOL:
            fam.fail(f"with {overrides} transformers' loss moves by only {moves[-1]:.1e}: the "
                     f"records do not exercise that feature")
    if moves:
        fam.notes.append(f"features live (loss moves >= {min(moves):.0e} without each)")


# LoRA on a MoE family's experts too: PEFT's target_parameters, which need dropout 0.
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
MOE_FAMILIES = ("mixtral", "qwen3_moe")


def check_lora(fam, train_path, eval_path, records, base_loss):
    extra = []
    if fam.name in MOE_FAMILIES:
        extra = ["--set", "lora.target_parameters=" + json.dumps(EXPERT_PARAMETERS),
                 "--set", "lora.dropout=0", "--set", "lora.train_router=true"]
    run_dir = train(fam, "lora", train_path, extra)
    final = os.path.join(run_dir, "final")
    peft_model = PeftModel.from_pretrained(hf_model(fam.base), final).eval()
    if not any("lora_" in n for n, _ in peft_model.named_parameters()):
        fam.fail("PeftModel holds no LoRA tensors from ft's adapter")
    hf = hf_loss(peft_model, records)
    fam.compare("lora", fam.ft_eval(fam.base, eval_path, adapter=final), hf)
    fam.moved("LoRA after training", base_loss, hf[0])
    # The merged model in the family's own layout (Phi-3's fused projections merged whole).
    merged = os.path.join(fam.dir, "merged")
    run([fam.ft, "export", "--checkpoint", run_dir, "--output", merged, "--merge-lora"],
        os.path.join(fam.dir, "export-merged.log"))
    model, info = hf_model(merged, output_loading_info=True)
    fam.check_loading("--merge-lora export", info)
    fam.compare("merged", {"loss": hf[0], "tokens": hf[1]}, hf_loss(model.eval(), records),
                ref="PEFT on final/")


def check_full(fam, train_path, eval_path, records, base_loss):
    run_dir = train(fam, "full", train_path, [])
    exported = os.path.join(fam.dir, "export")
    run([fam.ft, "export", "--checkpoint", run_dir, "--output", exported],
        os.path.join(fam.dir, "export.log"))
    for what, path in (("final/", os.path.join(run_dir, "final")), ("export", exported)):
        model, info = hf_model(path, output_loading_info=True)
        fam.check_loading(what, info)
        loss = hf_loss(model.eval(), records)
        fam.compare(what, fam.ft_eval(path, eval_path), loss)
        fam.moved(f"{what} after training", base_loss, loss[0])
    if tensor_names(exported) != tensor_names(fam.base):
        fam.fail(f"the export's tensors differ from the base's: only in the export "
                 f"{sorted(tensor_names(exported) - tensor_names(fam.base))}, only in the base "
                 f"{sorted(tensor_names(fam.base) - tensor_names(exported))}")
    base_cfg = AutoConfig.from_pretrained(fam.base).to_dict()
    export_cfg = AutoConfig.from_pretrained(exported).to_dict()
    diff = {k: (base_cfg.get(k), export_cfg.get(k)) for k in set(base_cfg) | set(export_cfg)
            if k not in CONFIG_NOISE and base_cfg.get(k) != export_cfg.get(k)}
    if diff:
        fam.fail(f"the export's config differs from the base's (base, export): {diff}")


def tensor_names(model_dir):
    """The tensor names of every safetensors file in a model directory (a tied head has none)."""
    names = set()
    for f in glob.glob(os.path.join(model_dir, "*.safetensors")):
        with safe_open(f, "pt") as st:
            names |= set(st.keys())
    return names


def check_peft_adapter(fam, eval_path, records):
    """An adapter PEFT wrote, evaluated by ft: on the family's projections by name, or (every other
    family) with "all-linear", which PEFT saves as every projection's full path, and rsLoRA."""
    # MoE families name their targets, the experts through target_parameters (all-linear on a MoE
    # model would also adapt the router, which ft keeps frozen).
    all_linear = list(FAMILIES).index(fam.name) % 2 == 1 and fam.name not in MOE_FAMILIES
    experts = (dict(target_parameters=EXPERT_PARAMETERS, modules_to_save=["gate"])
               if fam.name in MOE_FAMILIES else {})
    lcfg = LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0, bias="none",
                      target_modules="all-linear" if all_linear else FAMILIES[fam.name][2],
                      use_rslora=all_linear, **experts)
    torch.manual_seed(fam.seed + 100)
    peft_model = get_peft_model(hf_model(fam.base), lcfg)
    with torch.no_grad():  # PEFT starts lora_B at zero, which would hide the adapter
        for pname, p in peft_model.named_parameters():
            if "lora_B" in pname:
                p.normal_(0.0, 0.05)
            if "modules_to_save" in pname:  # a router trained in full: moved off the base's
                p.add_(torch.randn_like(p) * 0.05)
    adapter = os.path.join(fam.dir, "peft-adapter")
    peft_model.save_pretrained(adapter)
    fam.compare("peft-adapter" + (" (all-linear, rslora)" if all_linear else ""),
                fam.ft_eval(fam.base, eval_path, adapter=adapter),
                hf_loss(peft_model.eval(), records))


def check_family(fam, train_path, eval_path, records):
    build_base(fam)
    base_hf = hf_loss(hf_model(fam.base).eval(), records)
    fam.compare("base", fam.ft_eval(fam.base, eval_path), base_hf)
    check_features_live(fam, records, base_hf[0])
    check_lora(fam, train_path, eval_path, records, base_hf[0])
    check_full(fam, train_path, eval_path, records, base_hf[0])
    check_peft_adapter(fam, eval_path, records)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ft", required=True, help="the ft binary")
    ap.add_argument("--families", help=f"comma-separated subset of {','.join(FAMILIES)}")
    ap.add_argument("--keep", help="work in this directory and keep it (default: a temporary one)")
    args = ap.parse_args()
    names = args.families.split(",") if args.families else list(FAMILIES)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        ap.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    print(f"transformers {transformers.__version__}, peft {__import__('peft').__version__}, "
          f"torch {torch.__version__}")
    torch.set_num_threads(int(ONE_THREAD["OMP_NUM_THREADS"]))
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    work = args.keep or tempfile.mkdtemp(prefix="ft_families_")
    os.makedirs(work, exist_ok=True)
    try:
        failed = families(os.path.abspath(args.ft), work, names)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print("families: " + (f"FAILED {', '.join(failed)}" if failed else "all checks passed")
          + f" ({work})")
    return 1 if failed else 0


def families(ft, work, names):
    """Checks each family in turn (one failing does not stop the others); returns the failed."""
    train_path, eval_path, records = write_data(work)
    failed = []
    for name in names:
        fam = Family(ft, work, name, 4000 + list(FAMILIES).index(name))
        start = time.time()
        try:
            check_family(fam, train_path, eval_path, records)
        except Exception as e:  # a refusal by ft or PEFT is this family's failure, not the run's
            fam.fail(f"{type(e).__name__}: {e}")
        status = "ok  " if fam.ok else "FAIL"
        print(f"{status} {name:<12} {time.time() - start:4.1f} s  " + ", ".join(fam.notes),
              flush=True)
        if not fam.ok:
            failed.append(name)
    return failed


if __name__ == "__main__":
    sys.exit(main())
