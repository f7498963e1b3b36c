"""GPU smoke test of the Megatron policy worker: a few DAPO updates of a ~0.5B Qwen2-shaped model.

Ran on one H200 (2026-12-04) with ``--impl local`` in bf16: 47.8k tokens/s per update, 14.3% MFU,
32.5 GiB peak; packed 35.4k (docs/benchmarks.md). The TransformerEngine spec and FP8 (``--impl
auto`` where TE is installed) have NOT run yet: treat their first run's failures as bugs to fix.

What it does, on ONE GPU (an H200 is what it is sized for; <= 8 minutes, never in CI):

1. writes a Qwen2.5-0.5B-shaped config and random-init weights into a local folder (no hub);
2. builds ``MegatronPolicyWorker`` on it (TP = PP = DP = 1, bf16 weights, distributed optimizer):
   TransformerEngine layer spec with FP8 (format 'hybrid', 'delayed' scaling recipe) when
   ``transformer_engine`` imports, else the local spec in plain bf16;
3. checks that the CPU shims of ``policy/megatron/cpu_compat.py`` are inactive;
4. runs ``compute_log_prob`` then ``--steps`` DAPO updates (clip-higher PPO loss, token-mean over
   the mini-batch) on synthetic unpadded rows, and prints per-step tokens/s, MFU and peak memory;
   overlapped gradient reduce-scatter and parameter all-gather are on, as in the cluster presets;
5. checks an asynchronous checkpoint: saved in the background while the next update runs, then
   loaded, the same update replayed must give the same loss and gradient norm;
6. checks that packed micro-batches (THD: TransformerEngine's attention, or the local spec's SDPA
   row by row) give the padded ones' log-probs on rows of different lengths; ``--packing`` also
   trains packed, ``--varied-lengths`` on responses of random lengths (as real rollouts are);
7. times where an asynchronous save's blocking call goes (a second call, the HF copy, a
   synchronous save);
8. does what a colocated step does before its engines wake (``release_memory`` with
   ``release_grad_buffers``): the gradient buffers must leave the allocated memory, and one more
   update (which brings them back) must give a finite loss and gradient norm. Not run on a GPU yet.

MFU = 6 * N * tokens_per_s / peak, where N counts every parameter (embeddings included, tied
once) and attention-score FLOPs are left out, so it is the usual "6N" model-FLOPs estimate. The
peak is the H200's dense BF16 tensor-core peak, 989e12 FLOP/s (``--peak-flops`` to change it).
FP8 runs are reported against the same BF16 peak (not the ~1979e12 dense FP8 peak), so their MFU
compares directly with a BF16 run's. Only the update (forward + backward + optimizer) is timed;
the old-log-prob forward is timed separately (``logprob_s``). Step 0 is warm-up and left out.

Rows are unpadded on purpose: the TransformerEngine spec masks attention causally only (see the
worker's docstring), and FP8 GEMMs need token counts divisible by 16; ``--varied-lengths`` pads
on the right only, after every real token, where causal masking hides it.

Exit status: 0 when every step ran and produced finite numbers, non-zero otherwise; 2 when no GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

H200_BF16_DENSE_PEAK = 989e12  # FLOP/s, NVIDIA H200 SXM spec sheet, dense (no sparsity)

# Qwen2.5-0.5B's shape (about 494M parameters with tied embeddings)
QWEN2_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_theta=1000000.0,
)


def die(message: str, code: int = 1) -> None:
    print(f"ERROR: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def write_random_model(folder: str, layers: int) -> int:
    """Config + random-init safetensors, made on the GPU (fast) and saved as an HF folder."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{**QWEN2_05B, "num_hidden_layers": layers}, dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())  # tied weights counted once
    model.save_pretrained(folder, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    return n_params


def synthetic_batch(rows: int, prompt: int, response: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """Unpadded rows in the trainer's layout (prompt + response), with DAPO-style +-1 advantages."""
    gen = torch.Generator().manual_seed(seed)
    width = prompt + response
    ids = torch.randint(0, vocab, (rows, width), generator=gen)
    attention = torch.ones(rows, width, dtype=torch.long)
    loss_mask = attention[:, prompt:].clone()
    signs = torch.where(torch.arange(rows) % 2 == 0, 1.0, -1.0)
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "position_ids": torch.arange(width).expand(rows, -1).clone(),
        "responses": ids[:, prompt:],
        "loss_mask": loss_mask,
        "advantages": signs[:, None] * loss_mask.float(),
    }


def _prepend(batch: dict[str, torch.Tensor], extra: torch.Tensor, attention: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {
        "input_ids": torch.cat([extra, batch["input_ids"]], 1),
        "attention_mask": torch.cat([attention, batch["attention_mask"]], 1),
        "responses": batch["responses"],
        "loss_mask": batch["loss_mask"],
    }
    out["position_ids"] = (out["attention_mask"].cumsum(1) - 1).clamp(min=0)
    return out


def check_padding_is_masked(worker, batch: dict[str, torch.Tensor]) -> float:
    """Left padding must not change a row's log-probs (TE attention with ``padding_causal``).

    Row 0 gets 8 padding tokens (the other rows 8 more prompt tokens, so the padding is not
    trimmed); the change must be small next to what the same 8 tokens do when attended to.
    """
    rows, pad = batch["input_ids"].shape[0], 8
    extra = torch.randint(1, int(batch["input_ids"].max()) + 1, (rows, pad), generator=torch.Generator().manual_seed(7))
    padding = torch.ones(rows, pad, dtype=torch.long)
    padding[0] = 0
    mask = batch["loss_mask"][0].bool()
    base = worker.compute_log_prob(batch)["log_probs"][0]

    def change(variant):
        return float((worker.compute_log_prob(variant)["log_probs"][0] - base)[mask].abs().mean())

    masked, attended = change(_prepend(batch, extra, padding)), change(_prepend(batch, extra, torch.ones_like(padding)))
    print(f"left padding: mean |log-prob change| {masked:.2e} masked, {attended:.2e} if attended", flush=True)
    if masked > 0.2 * attended:
        die(f"left padding changed the log-probs by {masked:.3f} ({attended:.3f} when attended): it is not masked")
    return masked


def dapo_update(worker, batch: dict[str, torch.Tensor], old: dict[str, torch.Tensor], settings) -> dict:
    """One optimizer step on ``batch`` (one mini-batch) with ``old`` as the behaviour log-probs; its metrics."""
    from nemo_dapo.policy.base import MiniBatch

    mini = MiniBatch(
        {**batch, "old_log_probs": old["log_probs"]},
        float(batch["loss_mask"].sum()),
        float(batch["input_ids"].shape[0]),
    )
    return worker.update([mini], settings).metrics


def check_async_checkpoint(worker, folder: str, args, vocab: int, settings) -> dict:
    """Save in the background, update while it writes, finish; load and replay that update: the
    loss and gradient norm must come out again (the write holds the state of the save's start)."""
    batch = synthetic_batch(args.rows, args.prompt, args.response, vocab, seed=1234)
    t0 = time.perf_counter()
    worker.save(folder, asynchronous=True)
    save_call_s = time.perf_counter() - t0
    first = dapo_update(worker, batch, worker.compute_log_prob(batch), settings)
    t0 = time.perf_counter()
    worker.finish_save(blocking=True)
    finish_wait_s = time.perf_counter() - t0
    worker.load(folder)
    again = dapo_update(worker, batch, worker.compute_log_prob(batch), settings)
    gap = abs(again["actor/grad_norm"][0] - first["actor/grad_norm"][0]) / first["actor/grad_norm"][0]
    print(
        f"async checkpoint: save call {save_call_s:.1f}s, wait after one update {finish_wait_s:.1f}s; replayed "
        f"update grad norm {again['actor/grad_norm'][0]:.6f} vs {first['actor/grad_norm'][0]:.6f} "
        f"(relative gap {gap:.1e})",
        flush=True,
    )
    if gap > 1e-2 or worker.steps_done != args.steps + 1:
        die(f"the replayed update after loading differs (grad norm gap {gap:.2e}, steps_done {worker.steps_done})")
    return {
        "async_save_call_s": save_call_s,
        "async_save_wait_s": finish_wait_s,
        "replay_grad_norm_gap": gap,
        **time_save_parts(worker, folder),
    }


def time_save_parts(worker, folder: str) -> dict:
    """Where an asynchronous save's blocking call spends its time: a second async call (one-time
    set-up gone), the Hugging Face copy alone (an async save writes it from a thread; timed here
    inline), and a fully synchronous save."""
    from nemo_dapo.policy.megatron.checkpoint import _save_hf_weights

    parts = {}
    for name, action in (
        ("async_save_call_again_s", lambda: worker.save(folder + "_again", asynchronous=True)),
        ("async_save_finish_again_s", lambda: worker.finish_save(blocking=True)),
        ("hf_copy_s", lambda: _save_hf_weights(worker, folder + "_hf", asynchronous=False)),
        ("sync_save_s", lambda: worker.save(folder + "_sync", asynchronous=False)),
    ):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        action()
        torch.cuda.synchronize()
        parts[name] = time.perf_counter() - t0
    print("checkpoint parts: " + ", ".join(f"{k} {v:.1f}s" for k, v in parts.items()), flush=True)
    return parts


def varied_lengths(batch: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The rows' responses cut to random lengths (multiples of 16), right-padded as the trainer pads."""
    response = batch["responses"].shape[1]
    gen = torch.Generator().manual_seed(seed)
    lengths = 16 * torch.randint(1, response // 16 + 1, (batch["input_ids"].shape[0],), generator=gen)
    loss_mask = (torch.arange(response)[None] < lengths[:, None]).long()
    attention = torch.cat([batch["attention_mask"][:, :-response], loss_mask], 1)
    ids = batch["input_ids"] * attention
    return {
        **batch,
        "input_ids": ids,
        "attention_mask": attention,
        "responses": ids[:, -response:],
        "loss_mask": loss_mask,
        "advantages": batch["advantages"] * loss_mask,
    }


def check_packing_matches_padding(worker, batch: dict[str, torch.Tensor], train_packed: bool) -> float:
    """Packed and padded micro-batches must give the same log-probs (bf16 rounding apart)."""
    from dataclasses import replace

    log_probs = []
    for packing in (False, True):
        worker.layout = replace(worker.layout, sequence_packing=packing)
        log_probs.append(worker.compute_log_prob(batch)["log_probs"])
    worker.layout = replace(worker.layout, sequence_packing=train_packed)
    mask = batch["loss_mask"].bool()
    gap = float((log_probs[0] - log_probs[1])[mask].abs().mean())
    print(f"packing: mean |log-prob gap| packed vs padded {gap:.2e} over {int(mask.sum())} response tokens", flush=True)
    if gap > 5e-2:
        die(f"packed micro-batches change the log-probs by {gap:.3f} on average: rows see each other or are misplaced")
    return gap


def check_cpu_shims_inactive() -> None:
    from nemo_dapo.policy.megatron import cpu_compat as megatron_cpu_compat

    if megatron_cpu_compat.enable_cpu_compat() or megatron_cpu_compat._ENABLED:
        die("the CPU compatibility shims are active although CUDA is present")
    if not isinstance(torch.cuda.current_device(), int):
        die("torch.cuda.current_device is patched (CPU shim leaked into a GPU process)")
    if torch.zeros(1, device="cuda").device.type != "cuda":
        die("device='cuda' is redirected to the CPU (CudaToCpuMode leaked into a GPU process)")


def grad_buffer_bytes(worker) -> int:
    """Bytes the worker's gradient buffers hold (0 once released)."""
    return sum(b.grad_data.untyped_storage().nbytes() for c in worker.chunks for b in c.buffers)


def timed_updates(worker, args, n_params: int, vocab: int, settings) -> list[dict]:
    """``--steps`` DAPO updates, each after its old-log-prob pass; per-step timings and health.

    With ``--varied-lengths`` the responses are cut to random lengths as real rollouts are, so
    padded and packed micro-batches compute different numbers of tokens; tokens/s and MFU count
    the rows' real tokens either way."""
    results = []
    for step in range(args.steps):
        batch = synthetic_batch(args.rows, args.prompt, args.response, vocab, seed=step)
        if args.varied_lengths:
            batch = varied_lengths(batch, seed=step)
        torch.cuda.synchronize()
        t_lp = time.perf_counter()
        old = worker.compute_log_prob(batch)
        torch.cuda.synchronize()
        t_upd = time.perf_counter()
        metrics = dapo_update(worker, batch, old, settings)
        torch.cuda.synchronize()
        t_end = time.perf_counter()
        update_s = t_end - t_upd
        tokens = int(batch["attention_mask"].sum())
        tokens_s = tokens / update_s
        row = {
            "step": step,
            "tokens": tokens,
            "logprob_s": t_upd - t_lp,
            "update_s": update_s,
            "update_tokens_per_s": tokens_s,
            "mfu": 6 * n_params * tokens_s / args.peak_flops,
            "mean_old_log_prob": float(old["log_probs"].sum() / batch["loss_mask"].sum()),
            "pg_loss": metrics["actor/pg_loss"][0],
            "grad_norm": metrics["actor/grad_norm"][0],
            "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        }
        results.append(row)
        print(json.dumps(row), flush=True)
        bad = [k for k in ("mean_old_log_prob", "pg_loss", "grad_norm") if not math.isfinite(row[k])]
        if bad:
            die(f"step {step}: non-finite {bad}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="DAPO updates; the first is warm-up, not timed")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--response", type=int, default=768)
    parser.add_argument("--max-token-len", type=int, default=16384, help="tokens per micro-batch")
    parser.add_argument("--layers", type=int, default=QWEN2_05B["num_hidden_layers"])
    parser.add_argument("--impl", choices=["auto", "local", "transformer_engine"], default="auto")
    parser.add_argument("--no-fp8", action="store_true", help="bf16 even with TransformerEngine")
    parser.add_argument("--packing", action="store_true", help="train with sequence packing (THD on TE)")
    parser.add_argument(
        "--varied-lengths", action="store_true", help="train on responses cut to random lengths (multiples of 16)"
    )
    parser.add_argument("--peak-flops", type=float, default=H200_BF16_DENSE_PEAK)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        die(
            "no CUDA GPU visible (torch.cuda.is_available() is False): this smoke test needs one GPU "
            "and is never run in CI",
            code=2,
        )
    if (args.prompt + args.response) % 16:
        die("prompt + response must be a multiple of 16 (FP8 GEMM shapes)")
    check_cpu_shims_inactive()

    have_te = importlib.util.find_spec("transformer_engine") is not None
    impl = ("transformer_engine" if have_te else "local") if args.impl == "auto" else args.impl
    fp8 = "hybrid" if impl == "transformer_engine" and not args.no_fp8 else None
    device_name = torch.cuda.get_device_name()
    print(f"device: {device_name}; torch {torch.__version__}; transformer_engine importable: {have_te}")
    print(f"layer spec: {impl}; precision: {'fp8 hybrid / delayed scaling' if fp8 else 'bf16'}", flush=True)

    from nemo_dapo.config.schema_actor import MegatronConfig, OptimConfig
    from nemo_dapo.policy.base import LossSettings, WorkerSettings
    from nemo_dapo.policy.megatron.worker import MegatronPolicyWorker

    work = tempfile.mkdtemp(prefix="megatron_smoke_")
    model_dir = os.path.join(work, "model")
    t0 = time.perf_counter()
    n_params = write_random_model(model_dir, args.layers)
    print(
        f"random Qwen2 model: {n_params / 1e6:.1f}M parameters, {args.layers} layers, written in "
        f"{time.perf_counter() - t0:.1f}s to {model_dir}",
        flush=True,
    )

    t0 = time.perf_counter()
    worker = MegatronPolicyWorker(
        0,
        1,
        os.path.join(work, "rendezvous"),
        WorkerSettings(
            model_dir, OptimConfig(lr=1e-6, warmup_steps=0), dtype="bfloat16", max_token_len=args.max_token_len
        ),
        MegatronConfig(
            transformer_impl=impl,
            fp8=fp8,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
            sequence_packing=args.packing,
            release_grad_buffers=True,
        ),
    )
    print(
        f"worker built in {time.perf_counter() - t0:.1f}s; device {worker.device}; "
        f"backend {torch.distributed.get_backend()}",
        flush=True,
    )
    if worker.device.type != "cuda" or torch.distributed.get_backend() != "nccl":
        die("the worker did not take the GPU path (device cuda, nccl)")
    check_cpu_shims_inactive()

    vocab = QWEN2_05B["vocab_size"]
    settings = LossSettings()  # DAPO clip-higher (0.2 / 0.28), token-mean
    results = timed_updates(worker, args, n_params, vocab, settings)
    replay = check_async_checkpoint(worker, os.path.join(work, "checkpoint"), args, vocab, settings)
    padding_gap = check_padding_is_masked(worker, synthetic_batch(args.rows, args.prompt, args.response, vocab, 99))
    packing_gap = check_packing_matches_padding(
        worker, varied_lengths(synthetic_batch(args.rows, args.prompt, args.response, vocab, 98), 98), args.packing
    )
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    exported = sum(t.numel() * t.element_size() for bucket in worker.export_weights(512 << 20) for _, t in bucket)
    export_s = time.perf_counter() - t0
    print(f"streamed export of {exported / 2**30:.2f} GiB of HF weights in {export_s:.2f}s", flush=True)
    # what a colocated trainer does before its engines wake: the gradient buffers are freed
    # (actor.megatron.release_grad_buffers) and the allocator's cache goes back
    grads, allocated = grad_buffer_bytes(worker), torch.cuda.memory_allocated()
    reserved = torch.cuda.memory_reserved()
    released = worker.release_memory()
    if released != reserved - torch.cuda.memory_reserved() or torch.cuda.memory_reserved() > reserved:
        die(f"release_memory said {released} bytes; reserved went {reserved} -> {torch.cuda.memory_reserved()}")
    grads_freed = allocated - torch.cuda.memory_allocated()
    if grad_buffer_bytes(worker) or grads_freed < grads:
        die(f"the gradient buffers ({grads} bytes) were not freed: allocated memory fell by {grads_freed}")
    print(
        f"release_memory freed {grads_freed / 2**30:.2f} GiB of gradient buffers and gave back "
        f"{released / 2**30:.2f} of {reserved / 2**30:.2f} GiB reserved",
        flush=True,
    )
    after_release = timed_updates(worker, argparse.Namespace(**{**vars(args), "steps": 1}), n_params, vocab, settings)

    timed = results[1:] or results
    tokens_s = sum(r["tokens"] for r in timed) / sum(r["update_s"] for r in timed)
    summary = {
        "device": device_name,
        "layer_spec": impl,
        "fp8": fp8,
        "packing": args.packing,
        "varied_lengths": args.varied_lengths,
        "n_params": n_params,
        "tokens_per_step": sum(r["tokens"] for r in timed) / len(timed),
        "timed_steps": len(timed),
        "update_tokens_per_s": tokens_s,
        "mfu": 6 * n_params * tokens_s / args.peak_flops,
        "peak_flops_used": args.peak_flops,
        "padding_logprob_gap": padding_gap,
        "packing_logprob_gap": packing_gap,
        "export_s": export_s,
        **replay,
        "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "released_gib": released / 2**30,
        "grad_buffers_freed_gib": grads_freed / 2**30,
        "grad_norm_after_release": after_release[0]["grad_norm"],
        "reserved_before_release_gib": reserved / 2**30,
    }
    print("SUMMARY " + json.dumps(summary), flush=True)
    print(
        f"update throughput {tokens_s:,.0f} tokens/s; MFU {100 * summary['mfu']:.1f}% of "
        f"{args.peak_flops / 1e12:.0f} TFLOP/s (6N estimate); peak memory "
        f"{summary['max_memory_allocated_gib']:.1f} GiB"
    )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"summary": summary, "steps": results}, handle, indent=1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
