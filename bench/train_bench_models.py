"""train_bench_models: what bench/train_bench.py trains: the models and configurations it knows,
and the code that builds a model, its optimizer and its wrapped blocks.

Contract
- MODELS: model name -> (package needed or None, default batch, description); DEFAULT_MODELS: the
  budget suite's models without --models.
- CONFIGS: every configuration, in the default order; SPILLWAY_MODES: spillway configuration ->
  spillway.activations mode; WRAPPED: the configurations whose blocks are wrapped; CPU_CONFIGS:
  those that --smoke runs on CPU.
- build_model(torch, name, device) -> (model, blocks, make_batch, loss_fn): blocks are the
  (parent, attribute) pairs of the model's repeated blocks, make_batch(bs, gen) a batch on device,
  loss_fn(model, batch) the loss. Random weights; nothing is downloaded (transformers offline).
- make_optimizer(torch, name, model): SGD for resnet50 and mlp, AdamW for the others.
- wrap_blocks(torch, blocks, config): for a WRAPPED configuration, replaces every block by a
  BlockWrapper module that runs it through torch.utils.checkpoint(use_reentrant=False)
  ("checkpoint") or spillway.checkpoint (spillway-drop, spillway-hybrid); otherwise does nothing.
- Importing this module imports only the standard library: torch is passed in, and torchvision,
  transformers and spillway are imported where a model or wrapper needs them.
"""

import os

CONFIGS = ("native", "checkpoint", "save-on-cpu", "compile-budget", "spillway-alloc",
           "spillway-spill", "spillway-drop", "spillway-hybrid")
SPILLWAY_MODES = {"spillway-spill": "spill", "spillway-drop": "drop", "spillway-hybrid": "hybrid"}
WRAPPED = {"checkpoint", "spillway-drop", "spillway-hybrid"}   # blocks wrapped per configuration
CPU_CONFIGS = ("checkpoint", "save-on-cpu", "spillway-spill", "spillway-drop", "spillway-hybrid")

# model name -> (package needed, default batch, description). Batches were chosen without a GPU
# to give peaks of roughly 10-40 GB at fp32 on an 80 GB device; adjust with --batch.
MODELS = {
    "resnet50": ("torchvision", 128, "torchvision ResNet-50, 3x224x224, 1000 classes, SGD"),
    "gpt2-medium": ("transformers", 8, "GPT-2 medium (24 x 1024, 16 heads), 1024 tokens, LM loss, AdamW"),
    "bert-base": ("transformers", 32, "BERT-base MLM (BertConfig()), 512 tokens, 15% masked, AdamW"),
    "vit-b16": ("torchvision", 64, "torchvision ViT-B/16, 3x224x224, 1000 classes, AdamW"),
    "transformer": (None, 8, "24 pre-LN nn.TransformerEncoderLayer(1024, 16 heads, 4096), 1024 tokens, "
                             "vocab 32000, LM-style loss, AdamW (GPT-2-medium-sized, torch only)"),
    "mlp": (None, 256, "4 residual blocks Linear(256,1024)-GELU-Dropout-Linear(1024,256), MSE, SGD "
                       "(the smoke test's model)"),
}
DEFAULT_MODELS = ("resnet50", "gpt2-medium", "bert-base", "vit-b16")


# ================================================================================================
# Models: builders, optimizers, block wrappers
# ================================================================================================

class BlockWrapper:
    """Factory of an nn.Module running its inner block through a checkpoint function."""

    @staticmethod
    def make(torch, inner, run):
        class Wrapped(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = inner

            def forward(self, *args, **kwargs):
                return run(self.inner, *args, **kwargs)
        return Wrapped()


def build_model(torch, name, device):
    """(model, blocks, make_batch, loss_fn): blocks are (parent, attribute) pairs of the model's
    repeated blocks; make_batch(bs, gen) -> batch on device; loss_fn(model, batch) -> loss."""
    if name == "mlp":
        return _mlp(torch, device)
    if name == "transformer":
        return _transformer(torch, device)
    if name in ("resnet50", "vit-b16"):
        return _torchvision(torch, name, device)
    return _hf(torch, name, device)


def _image_batch(torch, device, classes=1000):
    def make(bs, gen):
        x = torch.randn(bs, 3, 224, 224, generator=gen).to(device)
        y = torch.randint(0, classes, (bs,), generator=gen).to(device)
        return x, y
    return make


def _mlp(torch, device):
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Dropout(0.1), nn.Linear(1024, 256))

        def forward(self, x):
            return x + self.body(x)

    model = nn.Sequential(*[Block() for _ in range(4)], nn.LayerNorm(256)).to(device)
    blocks = [(model, str(i)) for i in range(4)]

    def make(bs, gen):
        return (torch.randn(bs, 256, generator=gen).to(device), torch.randn(bs, 256, generator=gen).to(device))

    return model, blocks, make, lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])


def _transformer(torch, device, width=1024, layers=24, heads=16, vocab=32000, seq=1024):
    nn = torch.nn

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.layers = nn.ModuleList([nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.1,
                                                                    batch_first=True, norm_first=True)
                                         for _ in range(layers)])
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)

        def forward(self, ids):
            h = self.embed(ids)
            for layer in self.layers:
                h = layer(h)
            return self.head(self.norm(h))

    model = LM().to(device)
    blocks = [(model.layers, str(i)) for i in range(layers)]

    def make(bs, gen):
        return (torch.randint(0, vocab, (bs, seq), generator=gen).to(device),)

    def loss(m, b):
        logits = m(b[0])
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), b[0][:, 1:].reshape(-1))
    return model, blocks, make, loss


def _torchvision(torch, name, device):
    import torchvision
    if name == "resnet50":
        model = torchvision.models.resnet50(weights=None).to(device)
        blocks = [(getattr(model, f"layer{i}"), str(j)) for i in range(1, 5)
                  for j in range(len(getattr(model, f"layer{i}")))]
    else:
        model = torchvision.models.vit_b_16(weights=None).to(device)
        blocks = [(model.encoder.layers, n) for n, _ in model.encoder.layers.named_children()]
    return model, blocks, _image_batch(torch, device), \
        lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])


def _hf(torch, name, device):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import transformers
    if name == "gpt2-medium":
        cfg = transformers.GPT2Config(n_embd=1024, n_layer=24, n_head=16, n_positions=1024, use_cache=False)
        model = transformers.GPT2LMHeadModel(cfg).to(device)
        blocks = [(model.transformer.h, str(i)) for i in range(cfg.n_layer)]
        seq = 1024

        def make(bs, gen):
            ids = torch.randint(0, cfg.vocab_size, (bs, seq), generator=gen)
            return (ids.to(device),)

        return model, blocks, make, lambda m, b: m(input_ids=b[0], labels=b[0]).loss
    cfg = transformers.BertConfig()
    model = transformers.BertForMaskedLM(cfg).to(device)
    blocks = [(model.bert.encoder.layer, str(i)) for i in range(cfg.num_hidden_layers)]
    seq = 512

    def make(bs, gen):
        ids = torch.randint(0, cfg.vocab_size, (bs, seq), generator=gen)
        masked = torch.rand(bs, seq, generator=gen) < 0.15
        labels = torch.where(masked, ids, torch.full_like(ids, -100))
        return ids.to(device), labels.to(device)

    return model, blocks, make, lambda m, b: m(input_ids=b[0], labels=b[1]).loss


def make_optimizer(torch, name, model):
    if name in ("resnet50", "mlp"):
        return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def wrap_blocks(torch, blocks, config):
    if config not in WRAPPED:
        return
    if config == "checkpoint":
        from torch.utils.checkpoint import checkpoint

        def run(m, *a, **k):
            return checkpoint(m, *a, use_reentrant=False, **k)
    else:
        import spillway

        def run(m, *a, **k):
            return spillway.checkpoint(m, *a, **k)
    for parent, attr in blocks:
        setattr(parent, attr, BlockWrapper.make(torch, getattr(parent, attr), run))
