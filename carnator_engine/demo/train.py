"""Train the demo TinyVideoDiT on the evaluation world, then measure it with the world's analyzer.

    python3 -m carnator_engine.demo.train --out tiny_dit.safetensors --minutes 6
    python3 -m carnator_engine.demo.train --out /tmp/t.safetensors --smoke      # a CPU check
    python3 -m carnator_engine.demo.train --world v2 --out tiny_dit_v2.safetensors --minutes 6.5   # world v2

--world picks the evaluation world: v1 (world.py, one object, the default) or v2 (world2.py, scenes of two or
three objects); everything below holds for both, the held-out combinations being each world's HELDOUT_TRIPLES.

Clips are rendered on the fly on the training device (no dataset on disk); the colour-shape-direction
triples in world.HELDOUT_TRIPLES never appear in training. Flow matching as the engine samples it:
x_sigma = (1 - sigma) x0 + sigma noise, target v = noise - x0, sigmas logit-normal; prompts are
dropped to "" 10% of the time so classifier-free guidance works; AdamW with warm-up and cosine decay
over the time budget, an EMA of the weights, bf16 autocast on CUDA. At the end the EMA weights, cast
to fp16 exactly as shipped, sample held-out random prompts (Euler, flow_sigmas(steps)) at several
guidance scales; the analyzer scores each attribute. Weights go to --out (fp16 safetensors that
load_tiny_dit reads), the scores to --json.

The shipped weights came from four runs on one H200, 26.3 minutes in all (benchmarks/results/
demo_model/demo_model_accuracy.json holds every command, nested under "initialized_from", and
demo_model_train_stage4_log.txt the last run's log; eager steps are
launch-bound, so the compiled runs use a 4x batch):
    python3 -m carnator_engine.demo.train --out stage1.safetensors --minutes 6.5
    python3 -m carnator_engine.demo.train --init stage1.safetensors --out stage2.safetensors \
        --minutes 5 --batch 1024 --lr 8e-4 --warmup 200 --compile on --guidance 1,2,2.5,3,4 --seed 1
    python3 -m carnator_engine.demo.train --init stage2.safetensors --out stage3.safetensors \
        --minutes 7 --batch 1024 --lr 5e-4 --warmup 100 --compile on --guidance 2,2.5,3 --seed 2
    python3 -m carnator_engine.demo.train --init stage3.safetensors --out tiny_dit.safetensors \
        --minutes 7.8 --batch 1024 --lr 3e-4 --warmup 50 --compile on --guidance 2,2.5 --eval-every 90 --seed 3
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

from ..backbones.tiny_dit import TinyDiTConfig, TinyVideoDiT, load_tiny_dit, tokenize
from ..schedule import flow_sigmas
from . import world, world2

WORLDS = {"v1": world, "v2": world2}


def _log(message: str) -> None:
    print(message, flush=True)


def prompt_tokens(vocabulary: list, text_len: int, device) -> torch.Tensor:
    """Tokens of every prompt of the world, row = mixed-radix index of its codes; last row is ""."""
    prompts = [world.prompt(a) for a in world.all_combinations()] + [""]
    return tokenize(prompts, vocabulary, text_len).to(device)


def combination_index(codes: torch.Tensor) -> torch.Tensor:
    """codes [B, 6] -> row in all_combinations() (cartesian_prod order: last attribute fastest)."""
    index = torch.zeros_like(codes[:, 0])
    for column, name in enumerate(world.ATTRIBUTES):
        index = index * len(world.VALUES[name]) + codes[:, column]
    return index


@torch.no_grad()
def sample_clips(model, prompts: list, noise: torch.Tensor, steps: int = 20, guidance: float = 1.0,
                 shift: float = 3.0) -> torch.Tensor:
    """Batched Euler sampling, the same arithmetic as TinyDiTRunner (uncond prompt "")."""
    context, padding = model.encode_prompts(list(prompts))
    if guidance != 1.0:
        empty_context, empty_padding = model.encode_prompts([""])
        context = torch.cat([context, empty_context.expand_as(context)])
        padding = torch.cat([padding, empty_padding.expand_as(padding)])
    sigmas = flow_sigmas(steps, shift)
    x = noise.to(next(model.parameters()).device, torch.float32)
    for step in range(steps):
        sigma, sigma_next = float(sigmas[step]), float(sigmas[step + 1])
        model_in = x if guidance == 1.0 else torch.cat([x, x])
        v = model(model_in, torch.full((model_in.shape[0],), sigma, device=x.device), (context, padding))
        if guidance != 1.0:
            cond, uncond = v.chunk(2)
            v = uncond + guidance * (cond - uncond)
        x = x + (sigma_next - sigma) * v
    return x


def evaluate(model, attributes: list, seeds: list, guidance: float, steps: int, batch: int = 256,
             scene_world=world) -> dict:
    """The world's scores of the model's samples of these requests ('mean': of every score but 'all')."""
    reads = []
    for start in range(0, len(attributes), batch):
        chunk = attributes[start:start + batch]
        noise = scene_world.initial_noise(seeds[start:start + batch])
        clips = sample_clips(model, [scene_world.prompt(a) for a in chunk], noise, steps, guidance)
        reads += scene_world.analyze_batch(clips.clamp(-1, 1))
    scores = scene_world.attribute_accuracy(attributes, reads)
    parts = [name for name in scores if name != "all"]
    scores["mean"] = sum(scores[n] for n in parts) / len(parts)
    return {k: round(v, 4) for k, v in scores.items()}


def eval_requests(n: int, seed: int, heldout: str, scene_world=world) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    attributes = scene_world.decode(scene_world.sample_codes(n, generator, heldout=heldout))
    seeds = torch.randint(0, 2**31 - 1, (n,), generator=generator).tolist()
    return attributes, seeds


def training_tokens(scene_world, config: TinyDiTConfig, device):
    """tokens(codes, generator) -> the prompt token ids [B, text_len] of training codes: world v1 looks its
    4,000-odd prompts up in a table; world v2 builds them on the device, objects in a random order."""
    if scene_world is world:
        table = prompt_tokens(config.vocabulary, config.text_len, device)
        return lambda codes, generator: table[combination_index(codes)]
    return lambda codes, generator: scene_world.prompt_token_ids(codes, config.vocabulary, config.text_len, generator)


def training_device(name: str, seed: int) -> tuple:
    """(device, is_cuda), the global seed set and TF32 matmuls allowed on CUDA."""
    device = torch.device(name)
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return device, device.type == "cuda"


def report_requests(seed: int, random_prompts: int, heldout_prompts: int, scene_world=world) -> tuple:
    """The final report's two request sets: random prompts (held-out triples included) and held-out ones only."""
    return (eval_requests(random_prompts, seed + 1000, "include", scene_world),
            eval_requests(heldout_prompts, seed + 2000, "only", scene_world))


def learning_rate(base: float, step: int, warmup: int, fraction: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to 5 % over the time budget (`fraction` spent)."""
    return base * min(1.0, (step + 1) / warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * fraction)))


def optimise(model, ema, optimizer, loss: torch.Tensor, step: int, ema_decay: float) -> torch.Tensor:
    """One clipped AdamW step on `loss`, then the EMA update (its decay warms up over the first steps)."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    beta = min(ema_decay, (1 + step) / (10 + step))
    with torch.no_grad():
        torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1 - beta)
    return loss.detach()


def shipped_copy(ema: TinyVideoDiT) -> TinyVideoDiT:
    """The EMA weights rounded through fp16, as load_tiny_dit will see them."""
    model = copy.deepcopy(ema).half().float().eval()
    return model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="weights (.safetensors, fp16 EMA)")
    parser.add_argument("--json", help="accuracy report (default: --out with .json)")
    parser.add_argument("--world", choices=tuple(WORLDS), default="v1",
                        help="evaluation world: v1 one object, v2 scenes of two or three objects")
    parser.add_argument("--minutes", type=float, default=6.0, help="training wall-clock budget")
    parser.add_argument("--smoke", action="store_true", help="a few CPU-sized steps, to check the script")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--warmup", type=int, default=400)
    parser.add_argument("--ema", type=float, default=0.999)
    parser.add_argument("--text-dropout", type=float, default=0.1)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="Euler steps when sampling for the report")
    parser.add_argument("--guidance", default="1,1.5,2,3,4", help="guidance scales tried in the report")
    parser.add_argument("--eval-prompts", type=int, default=512)
    parser.add_argument("--eval-heldout", type=int, default=256)
    parser.add_argument("--eval-every", type=float, default=75.0, help="seconds between progress evals")
    parser.add_argument("--compile", choices=("on", "off"), default="off",
                        help="torch.compile the DiT (its compile time comes out of the budget)")
    parser.add_argument("--init", help="start from these weights (a checkpoint of this script); its .json, "
                                       "if beside it, is kept in the report as the earlier stage")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch, args.warmup, args.minutes = min(args.batch, 4), 2, 0.0
        args.eval_prompts, args.eval_heldout, args.steps, args.guidance = 8, 4, 2, "1,2"
        args.dim, args.layers, args.eval_every = 32, 2, 1e9
    scene_world = WORLDS[args.world]
    json_path = args.json or os.path.splitext(args.out)[0] + ".json"
    device, cuda = training_device(args.device, args.seed)

    earlier_stage = None
    if args.init:
        model = load_tiny_dit(args.init, str(device)).train()
        config = model.config
        if config.vocabulary != list(scene_world.VOCABULARY) or config.text_len != scene_world.TEXT_LEN:
            raise ValueError(f"{args.init} was trained on another vocabulary than this world's")
        args.dim, args.layers, args.heads = config.dim, config.layers, config.heads
        with open(args.init, "rb") as handle:
            earlier_stage = {"weights": args.init, "sha256": hashlib.sha256(handle.read()).hexdigest()}
        stage_json = os.path.splitext(args.init)[0] + ".json"
        if os.path.exists(stage_json):
            with open(stage_json) as handle:
                earlier = json.load(handle)
            earlier_stage.update({k: earlier.get(k) for k in ("training", "command", "accuracy", "recommended_guidance")})
        _log(f"initialised from {args.init}")
    else:
        config = TinyDiTConfig(vocabulary=list(scene_world.VOCABULARY), text_len=scene_world.TEXT_LEN, dim=args.dim,
                               layers=args.layers, heads=args.heads)
        model = TinyVideoDiT(config).to(device).train()
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    parameters = sum(p.numel() for p in model.parameters())
    _log(f"device {device} ({torch.cuda.get_device_name(device) if cuda else 'cpu'}), torch {torch.__version__}, "
         f"{parameters / 1e6:.2f}M parameters, dim {args.dim} x {args.layers} layers, batch {args.batch}")

    decay, no_decay = [], []   # weight decay on matrices only, not on biases, norms, positions, embeddings
    for name, p in model.named_parameters():
        matrix = p.ndim == 2 and not name.endswith("_pos") and name != "text.embed.weight"
        (decay if matrix else no_decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.99), fused=cuda)
    tokens_of = training_tokens(scene_world, config, device)
    generator = torch.Generator(device=device).manual_seed(args.seed)

    forward = model
    if args.compile == "on":
        forward = torch.compile(model)

    def train_step(step: int, lr: float) -> torch.Tensor:
        codes = scene_world.sample_codes(args.batch, generator, device, heldout="exclude")
        x0 = scene_world.render_codes(codes, generator)
        tokens = tokens_of(codes, generator)
        dropped = torch.rand(args.batch, generator=generator, device=device) < args.text_dropout
        tokens = torch.where(dropped[:, None], torch.zeros_like(tokens), tokens)   # "" tokenizes to all PAD
        sigma = torch.sigmoid(torch.randn(args.batch, generator=generator, device=device))
        noise = torch.randn(x0.shape, generator=generator, device=device)
        s = sigma[:, None, None, None, None]
        x_sigma = (1 - s) * x0 + s * noise
        for group in optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            text = model.text(tokens)
            v = forward(x_sigma, sigma, text)
        return optimise(model, ema, optimizer, F.mse_loss(v.float(), noise - x0), step, args.ema)

    budget = args.minutes * 60.0
    start = time.time()
    step, seen, smooth, progress = 0, 0, None, []
    last_log = last_eval = start
    compile_seconds = None
    quick = eval_requests(128 if not args.smoke else 4, args.seed + 7, "exclude", scene_world)
    while True:
        elapsed = time.time() - start
        if (args.smoke and step >= 3) or (not args.smoke and elapsed >= budget):
            break
        fraction = min(1.0, elapsed / budget) if budget > 0 else 1.0
        lr = learning_rate(args.lr, step, args.warmup, fraction)
        try:
            loss = train_step(step, lr)
        except Exception as error:   # a compiler that fails here must not cost the run
            if forward is model:
                raise
            _log(f"torch.compile failed ({type(error).__name__}: {str(error)[:200]}); training eagerly")
            forward = model
            loss = train_step(step, lr)
        if step == 0:
            value = float(loss)
            if not math.isfinite(value):
                raise RuntimeError(f"first loss is {value}: check the text encoder on empty prompts on {device}")
            compile_seconds = round(time.time() - start, 1)
            _log(f"first step done in {compile_seconds}s (loss {value:.4f})")
        step += 1
        seen += args.batch
        now = time.time()
        if now - last_log >= 15 or args.smoke:
            value = float(loss)
            smooth = value if smooth is None else 0.7 * smooth + 0.3 * value
            if not math.isfinite(value):
                raise RuntimeError(f"loss became {value} at step {step}")
            _log(f"step {step:6d}  {now - start:6.1f}s  loss {value:.4f} (smoothed {smooth:.4f})  lr {lr:.2e}  "
                 f"{step / (now - start):.1f} it/s")
            last_log = now
        if now - last_eval >= args.eval_every:
            scores = {g: evaluate(shipped_copy(ema), *quick, guidance=g, steps=args.steps, scene_world=scene_world)
                      for g in (1.0, 3.0)}
            progress.append({"step": step, "seconds": round(now - start, 1), "loss": round(float(loss), 4),
                             "guidance_1": scores[1.0], "guidance_3": scores[3.0]})
            _log(f"  eval @ {step}: g=1 {scores[1.0]}  g=3 {scores[3.0]}")
            last_eval = time.time()
    train_seconds = time.time() - start
    _log(f"trained {step} steps, {seen} clips in {train_seconds:.0f}s")

    shipped = shipped_copy(ema)
    copy.deepcopy(shipped).half().save(args.out)   # before the evaluation: a run cut short keeps its weights
    evaluation_start = time.time()
    random_set, heldout_set = report_requests(args.seed, args.eval_prompts, args.eval_heldout, scene_world)
    truth = scene_world.attribute_accuracy(random_set[0], scene_world.analyze_batch(
        scene_world.render_batch(random_set[0], seed=args.seed + 3000)))
    results = {}
    for guidance in [float(g) for g in args.guidance.split(",")]:
        results[guidance] = {
            name: evaluate(shipped, *requests, guidance=guidance, steps=args.steps, scene_world=scene_world)
            for name, requests in (("random", random_set), ("heldout", heldout_set))}
        _log(f"guidance {guidance}: random {results[guidance]['random']}\n"
             f"              held-out {results[guidance]['heldout']}")
    best = max(results, key=lambda g: (results[g]["random"]["mean"], results[g]["random"]["all"]))
    report = {
        "model": {"path": os.path.basename(args.out), "parameters": parameters, "dim": args.dim,
                  "layers": args.layers, "heads": args.heads, "dtype": "float16 (EMA)",
                  "bytes": os.path.getsize(args.out)},
        "training": {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
                     "seconds": round(train_seconds, 1), "first_step_seconds": compile_seconds,
                     "compiled": forward is not model, "steps": step, "clips_seen": seen, "batch": args.batch,
                     "lr": args.lr, "warmup": args.warmup, "ema": args.ema, "text_dropout": args.text_dropout,
                     "sigmas": "logit-normal (sigmoid of N(0,1))", "seed": args.seed,
                     "world": args.world, "heldout_triples": [list(t) for t in scene_world.HELDOUT_TRIPLES],
                     "final_loss": round(float(loss), 4), "progress": progress},
        "sampling": {"sampler": "euler", "steps": args.steps, "sigmas": f"flow_sigmas({args.steps}, shift=3.0)",
                     "noise": f"{args.world} initial_noise(seed)", "uncond_prompt": ""},
        "evaluation": {"seconds": round(time.time() - evaluation_start, 1), "random_prompts": args.eval_prompts, "heldout_prompts": args.eval_heldout,
                       "analyzer_on_ground_truth": {k: round(v, 4) for k, v in truth.items()},
                       "by_guidance": {str(g): r for g, r in results.items()}},
        "recommended_guidance": best,
        "accuracy": results[best]["random"],
        "heldout_accuracy": results[best]["heldout"],
        "initialized_from": earlier_stage,
        "command": " ".join(["python3", "-m", "carnator_engine.demo.train"] + list(argv if argv is not None else sys.argv[1:])),
    }
    with open(json_path, "w") as handle:
        json.dump(report, handle, indent=2)
    _log(f"best guidance {best}: {results[best]['random']}")
    _log(f"wrote {args.out} ({os.path.getsize(args.out) / 1e6:.2f} MB) and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
