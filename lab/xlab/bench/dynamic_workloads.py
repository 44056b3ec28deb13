"""The dynamic-shape benchmark's workloads (xlab.bench.dynamic; Note [Dynamic-shape benchmark] there):
`warmup` steps, then `steps` steps inside `window` (an xlab.experiments.train.Window), all drawn from `seed`, so
every arm of every trial sees the same requests; the first warm-up step has the largest shape. `small`: sizes and
models that run in seconds on a CPU.

- cupy_mix: rfft, sort, cumsum and matmul of random sizes, OPS a step, each result kept 2**U(0, 5) steps; `scale`
  makes every result that many times larger (xlab.bench.dynamic_scale).
- cupy_image: an image and volume pipeline over random crop sizes (cupyx.scipy.ndimage: gaussian blur, Sobel
  edges, zoom; an FFT of each result), results kept 2**U(0, 3) steps; on a CPU, scipy.ndimage and NumPy's FFT.
- cupy_fill: a job that fills most of the GPU: FILL_ARRAYS arrays a step of sizes log-uniform in FILL_SIZES, each
  written and kept 2**U(0, 5) steps (fill_plan: the requests, known without running them); `scale` makes every
  request that many times larger (x64 in xlab.bench.dynamic_scale: 1 MiB-1 GiB, a peak of 35-38 GiB).
- gpt: tapegpt's GPT (reference config) trained on CuPy at lengths(lo, hi) tokens a step.
- torch_lm: a causal pre-norm torch.nn.TransformerEncoder (6 layers, d_model 512, 8 heads), AdamW, bf16 autocast.
- resnet: a ResNet-18 (basic blocks 2-2-2-2, 64-512 channels, written out here: no torchvision), channels_last,
  bf16 autocast, SGD with momentum, on seeded random images of sizes(lo, hi) pixels a side (multi-scale training).
"""
from __future__ import annotations

import importlib

import numpy as np

OPS = 6                          # cupy_mix: operations per step
FFT_LENGTHS = tuple(sorted(m << k for m in (1, 3, 5) for k in range(12, 17)))   # 15: CuPy's plan cache keeps 16
LIFETIMES = (0.0, 5.0)           # cupy_mix: a result lives 2**U(0, 5) steps
IMAGE_SIDES = (256, 2048)        # cupy_image: a crop's side in pixels (small: 16-64); a volume's is side ** (2/3)
IMAGE_LIFETIMES = (0.0, 3.0)     # cupy_image: a step's results live 2**U(0, 3) steps
FILL_SIZES = (16 << 10, 16 << 20)   # cupy_fill: bytes of an array (small: 1/64 of these), log-uniform
FILL_ARRAYS = 22                 # cupy_fill: arrays a step (the count that puts x64 at 35-38 GiB: dynamic_scale)


def lengths(n: int, lo: int, hi: int | None, seed: int, multiple: int = 1) -> list[int]:
    """n sequence lengths: `hi` first, then drawn uniformly from the multiples of `multiple` in [lo, hi] (from seed);
    all `lo` when hi is None."""
    if hi is None:
        return [lo] * n
    drawn = np.random.default_rng([seed, 1]).integers(lo // multiple, hi // multiple + 1, size=n - 1) * multiple
    return [hi] + [int(t) for t in drawn]


def _loop(step, shapes, warmup, window, after_step):
    def steps(first, shapes):
        for i, shape in enumerate(shapes, first):
            step(i, shape)
            after_step()
    steps(0, shapes[:warmup])
    with window:
        steps(warmup, shapes[warmup:])
        window.dispatched()


def _xp(gpu):
    return importlib.import_module("cupy") if gpu else np


def cupy_mix(steps, warmup, seed, window, gpu=True, small=False, after_step=lambda: None, *, scale: int = 1) -> dict:
    """CuPy arrays of random sizes and mixed lifetimes; the inputs views of one array, so only results allocate.
    scale: every request `scale` times the benchmark's, from the same draws (Note [cupy_mix at scale])."""
    if isinstance(scale, bool) or not isinstance(scale, int) or scale < 1:
        raise ValueError(f"scale must be a whole number >= 1, got {scale!r}")
    xp, rng = _xp(gpu), np.random.default_rng([seed, 2])
    n_max, m_max, ffts = (1 << 12, 64, (256, 384, 640)) if small else (1 << 22, 2048, FFT_LENGTHS)
    n_max, ffts = n_max * scale, tuple(n * scale for n in ffts)
    side, k_max = round(m_max * scale ** 0.5), max(16, round(m_max / scale ** 0.5))
    base = xp.linspace(-1, 1, n_max, dtype=np.float32)
    ring = []                                             # (last step it lives, array)

    def op(kind, f, j):                                   # f: fractions of the largest sizes; j: FFT length
        if kind == 0:
            return xp.fft.rfft(base[:ffts[j]])
        if kind == 3:
            m, k, n = (max(16, int(top * x)) for top, x in zip((side, k_max, side), f))
            return base[:m * k].reshape(m, k) @ base[:k * n].reshape(k, n)
        n = max(512, int(n_max * f[0]))
        return xp.sort(base[:n]) if kind == 1 else xp.cumsum(base[:n])

    def step(i, largest):                                 # the largest step: every op at its largest, every FFT
        ops = ([(k, (1, 1, 1), len(ffts) - 1) for k in range(4)] + [(0, None, j) for j in range(len(ffts))]
               if largest else [(int(rng.integers(4)), 2.0 ** rng.uniform(-8, 0, 3), int(rng.integers(len(ffts))))
                                for _ in range(OPS)])
        for kind, f, j in ops:
            ring.append((i + int(2 ** rng.uniform(*LIFETIMES)), op(kind, f, j)))
        ring[:] = [(t, a) for t, a in ring if t > i]

    _loop(step, [True] + [False] * (warmup + steps - 1), warmup, window, after_step)
    ring.clear()
    if gpu:
        xp.fft.config.get_plan_cache().clear()           # its plans hold work areas from the allocator
    return dict(batch=0, shape=f"{OPS} ops/step, up to {n_max} floats, matmul up to {side}"
                + (f" (k up to {k_max})" if k_max != side else ""))


# Note [cupy_mix at scale]
# cupy_mix(scale=s) draws what scale 1 draws (the same kinds, fractions, FFT indices and lifetimes from the seed) and
# makes every request s times larger: the base array and the sort and cumsum lengths times s, each FFT length times s
# (rfft's result grows with it; 15 lengths stay within CuPy's plan cache of 16 plans, memsize unlimited by default,
# so once warm no plan is made and no work area allocated; an s whose prime factors are 2, 3 and 5 keeps them
# lengths cuFFT is fast at), and the matmul's m and n times sqrt(s) each, so its m x n result is s times larger while
# k shrinks by sqrt(s): a tall-skinny product whose inputs (views of the base) stay today's size and whose FLOPs grow
# by sqrt(s) only (the largest at s = 216: 2 x 30099^2 x 139 = 0.25 TFLOP, ~5 ms in FP32 on an H200, where a square
# one of that result would be 55 TFLOP). So the live bytes of every step are s times scale 1's to within the
# rounding of sizes and of cuFFT's work areas, and scale 1 is the benchmark as it was (the same sizes and `shape`).


def _ndimage(gpu):
    """cupyx.scipy.ndimage on a GPU; scipy.ndimage, which it mirrors, on a CPU."""
    return importlib.import_module("cupyx.scipy.ndimage" if gpu else "scipy.ndimage")


def image_plan(n: int, seed: int, small: bool = False) -> list[list[dict]]:
    """cupy_image's n steps, drawn from seed: per step the crop's side, whether it is a volume, the blur's sigma and
    the zoom factor, and each result's lifetime in steps; step 0 is the largest (an image and a volume at the
    largest side, zoomed x2)."""
    rng, (lo, hi) = np.random.default_rng([seed, 4]), (16, 64) if small else IMAGE_SIDES
    plan = []
    for i in range(n):
        if i == 0:
            crops = [(hi, False, 2.0, 2.0), (hi, True, 2.0, 2.0)]
        else:
            crops = [(int(rng.integers(lo, hi + 1)), bool(rng.random() < 0.25), float(rng.uniform(0.5, 4.0)),
                      float(2 ** rng.uniform(-1, 1)))]
        plan.append([dict(side=side, volume=vol, sigma=sigma, zoom=zoom,
                          life=int(2 ** rng.uniform(*IMAGE_LIFETIMES))) for side, vol, sigma, zoom in crops])
    return plan


def cupy_image(steps, warmup, seed, window, gpu=True, small=False, after_step=lambda: None) -> dict:
    """An image and volume pipeline over random crop sizes (image_plan): each crop of a seeded image (a volume's of
    a seeded volume) blurred (gaussian_filter), its Sobel edge magnitude, that zoomed (order 1), and the zoomed
    result's magnitude spectrum (rfftn); the zoomed image and its spectrum kept for the crop's lifetime (a queue of
    results written out later), the rest freed with the step. cuFFT plans a new shape on most steps (CuPy's cache
    keeps 16): their work areas come from the allocator too, as in a user's pipeline."""
    xp, ndi = _xp(gpu), _ndimage(gpu)
    hi = 64 if small else IMAGE_SIDES[1]
    vhi = round(hi ** (2 / 3))
    data = np.random.default_rng([seed, 5])
    image = xp.asarray(data.standard_normal((hi, hi), dtype=np.float32))
    volume = xp.asarray(data.standard_normal((vhi,) * 3, dtype=np.float32))
    plan, ring = image_plan(warmup + steps, seed, small), []

    def process(c):
        src = volume[(slice(0, max(4, round(c["side"] ** (2 / 3)))),) * 3] if c["volume"] else \
            image[:c["side"], :c["side"]]
        blur = ndi.gaussian_filter(src, c["sigma"])
        edges = xp.sqrt(sum(ndi.sobel(blur, axis=a) ** 2 for a in range(blur.ndim)))
        del blur
        zoomed = ndi.zoom(edges, c["zoom"], order=1)
        del edges
        return zoomed, xp.abs(xp.fft.rfftn(zoomed))

    def step(i, crops):
        for c in crops:
            ring.append((i + c["life"], process(c)))
        ring[:] = [(t, a) for t, a in ring if t > i]

    _loop(step, plan, warmup, window, after_step)
    ring.clear()
    if gpu:
        xp.fft.config.get_plan_cache().clear()           # its plans hold work areas from the allocator
    lo = 16 if small else IMAGE_SIDES[0]
    return dict(batch=0, shape=f"crops {lo}-{hi} px (volumes {round(lo ** (2 / 3))}-{vhi} a side), zoom x0.5-2")


def fill_plan(n: int, seed: int, small: bool = False, scale: int = 1) -> list[list[tuple[int, int]]]:
    """cupy_fill's requests over n steps, drawn from seed: per step FILL_ARRAYS (bytes, the last step it lives),
    bytes log-uniform in FILL_SIZES (small: 1/64 of them) times `scale`, lifetimes 2**U(0, 5) steps (LIFETIMES);
    step 0's first array is the largest. The same draws at every scale."""
    if isinstance(scale, bool) or not isinstance(scale, int) or scale < 1:
        raise ValueError(f"scale must be a whole number >= 1, got {scale!r}")
    rng = np.random.default_rng([seed, 3])
    lo, hi = (n_ // 64 for n_ in FILL_SIZES) if small else FILL_SIZES
    plan = []
    for i in range(n):
        sizes = 2 ** rng.uniform(np.log2(lo), np.log2(hi), FILL_ARRAYS)
        if i == 0:
            sizes[0] = hi
        lives = 2 ** rng.uniform(*LIFETIMES, FILL_ARRAYS)
        plan.append([(int(b) * scale, i + int(t)) for b, t in zip(sizes, lives)])
    return plan


def plan_peak(plan) -> int:
    """The most bytes a fill_plan keeps live at once (a step's arrays made, then those whose last step it is freed:
    as cupy_fill runs it)."""
    live, peak, ring = 0, 0, []
    for i, made in enumerate(plan):
        for b, last in made:
            live += b
            peak = max(peak, live)
            ring.append((last, b))
        live -= sum(b for last, b in ring if last <= i)
        ring = [(last, b) for last, b in ring if last > i]
    return peak


def cupy_fill(steps, warmup, seed, window, gpu=True, small=False, after_step=lambda: None, *, scale: int = 1) -> dict:
    """A job that fills most of the GPU with arrays of mixed sizes and lifetimes (fill_plan): each array made
    (uint8, its planned bytes) and written, kept until its last step; `scale` times the benchmark's bytes."""
    xp = _xp(gpu)
    plan, ring = fill_plan(warmup + steps, seed, small, scale), []

    def step(i, made):
        for b, last in made:
            a = xp.empty(b, dtype=np.uint8)
            a.fill(i % 251)
            ring.append((last, a))
        ring[:] = [(t, a) for t, a in ring if t > i]

    _loop(step, plan, warmup, window, after_step)
    ring.clear()
    lo, hi = ((n // 64 for n in FILL_SIZES) if small else FILL_SIZES)
    return dict(batch=0, shape=f"{FILL_ARRAYS} arrays/step, {lo * scale}-{hi * scale} B")


def gpt(steps, warmup, seed, window, gpu=True, small=False, after_step=lambda: None, *, batch: int, lo: int,
        hi: int | None = None) -> dict:
    """tapegpt's GPT ('tiny' when small) at `batch` sequences of lengths(lo, hi), the experiments' step."""
    from tapegpt import GPT, AdamW, get_batch, load_corpus
    from xlab.experiments import train
    xp, cfg, data = _xp(gpu), train.make_config("tiny" if small else None), load_corpus()
    if small:
        lo, hi = max(2, lo * cfg.block_size // 256), hi and cfg.block_size
    model = GPT(cfg, xp=xp, seed=train.SEED)
    opt = AdamW(model.params, lr=train.LR, weight_decay=train.WEIGHT_DECAY, foreach=train.adamw_form() == "foreach")

    def step(i, T):
        train.train_step(model, opt, *get_batch(data, batch, T, i, seed=seed, xp=xp))

    _loop(step, lengths(warmup + steps, lo, hi, seed), warmup, window, after_step)
    del model, opt
    return dict(batch=batch, shape=f"T {lo}-{hi}" if hi else f"T {lo}")


def _torch_step(torch, opt, device, loss) -> None:
    """One training step of the PyTorch workloads: loss() under bf16 autocast, its gradients, the optimizer."""
    with torch.autocast(device, dtype=torch.bfloat16):
        value = loss()
    opt.zero_grad(set_to_none=True)
    value.backward()
    opt.step()


def torch_lm(steps, warmup, seed, window, gpu=True, small=False, after_step=lambda: None, *, lo: int,
             hi: int | None = None, batch: int = 16, multiple: int = 64, after_build=lambda: None) -> dict:
    """The PyTorch language model (see the module doc) on the shipped corpus, lengths(lo, hi) tokens a step, in
    multiples of 64 (length buckets, as training loops batch them): with any length, the H200's quick run took
    ~190 ms a step under every allocator alike against ~20 ms at a fixed length (per-shape work in PyTorch, not
    allocation), which would drown the allocators' differences (the H200's run at 4566408; its log is in the record,
    tag record-2026-12-05). after_build(): called once the model and its optimizer are made."""
    import torch
    from torch import nn

    from tapegpt import get_batch, load_corpus
    device, data = "cuda" if gpu else "cpu", load_corpus()
    (d, n_layer, n_head), max_len = ((32, 2, 2), 32) if small else ((512, 6, 8), 512)
    if small:
        lo, hi, batch, multiple = lo // 16, hi and hi // 16, 2, 4
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(d, n_head, 4 * d, batch_first=True, norm_first=True)
    m = nn.ModuleDict(dict(tok=nn.Embedding(256, d), pos=nn.Embedding(max_len, d), head=nn.Linear(d, 256),
                           enc=nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False))).to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-4)
    after_build()

    def step(i, T):
        x, y = (torch.from_numpy(a).to(device) for a in get_batch(data, batch, T, i, seed=seed))
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=device)

        def loss():
            h = m["enc"](m["tok"](x) + m["pos"](torch.arange(T, device=device)), mask=mask, is_causal=True)
            return nn.functional.cross_entropy(m["head"](h).flatten(0, 1), y.flatten())
        _torch_step(torch, opt, device, loss)

    _loop(step, lengths(warmup + steps, lo, hi, seed, multiple), warmup, window, after_step)
    del m, opt
    return dict(batch=batch, shape=f"T {lo}-{hi} by {multiple}" if hi else f"T {lo}")


def _resnet18(nn, width: int, blocks: tuple, classes: int):
    """ResNet-18's layout (He et al. 2016; torchvision's resnet18): a 7x7 stem, four stages of basic blocks."""
    class Basic(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                                      nn.ReLU(inplace=True), nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
                                      nn.BatchNorm2d(cout))
            self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x):
            return self.relu(self.body(x) + self.skip(x))

    layers, cin = [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                   nn.MaxPool2d(3, 2, 1)], width
    for i, n in enumerate(blocks):
        for j in range(n):
            layers.append(Basic(cin, width << i, 2 if i and not j else 1))
            cin = width << i
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))


def resnet(steps, warmup, seed, window, gpu=True, small=False, after_step=lambda: None, *, lo: int,
           hi: int | None = None, batch: int = 32, multiple: int = 32, after_build=lambda: None) -> dict:
    """ResNet-18 (see the module doc) on random images of lengths(lo, hi) pixels a side, in multiples of 32 (the
    network's stride), drawn from seed on the device; 100 classes. after_build(): called once the model and its
    optimizer are made (a reserve made there: python -m xlab.bench.reserve --when build)."""
    import torch
    from torch import nn

    device = "cuda" if gpu else "cpu"
    width, blocks = (8, (1, 1, 1, 1)) if small else (64, (2, 2, 2, 2))
    if small:
        lo, hi, batch, multiple = lo // 8, hi and hi // 8, 2, 4
    torch.manual_seed(seed)
    m = _resnet18(nn, width, blocks, 100).to(device, memory_format=torch.channels_last)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    gen = torch.Generator(device)
    after_build()

    def step(i, side):
        gen.manual_seed(seed * 1_000_003 + i)
        x = torch.randn(batch, 3, side, side, device=device, generator=gen).to(memory_format=torch.channels_last)
        y = torch.randint(0, 100, (batch,), device=device, generator=gen)
        _torch_step(torch, opt, device, lambda: nn.functional.cross_entropy(m(x), y))

    _loop(step, lengths(warmup + steps, lo, hi, seed, multiple), warmup, window, after_step)
    del m, opt
    return dict(batch=batch, shape=f"{lo}-{hi} px by {multiple}" if hi else f"{lo} px")
