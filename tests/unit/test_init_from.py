"""`model.init_from`: a Hugging Face DeepSeek checkpoint as the run's initial weights, one process.
The first step's loss equals transformers' on the same batch (fp32 and bf16 checkpoints, V3 and
V2); an FP8 checkpoint dequantises exactly (against an fp64 reference, blocks that do not divide
the shape included) and its loss is off by the quantisation error alone; a missing, extra or
mis-shaped tensor is one error naming it and the fix. The distributed layouts are in
tests/distributed/test_init_from.py."""

import pytest
import torch

pytest.importorskip("transformers")

from dstrain.config.load import load_config  # noqa: E402
from dstrain.errors import UserError  # noqa: E402
from dstrain.model.hf_adapter import save_hf_checkpoint, to_hf, with_mtp_copies  # noqa: E402
from dstrain.model.hf_load import HFCheckpoint  # noqa: E402
from dstrain.model.transformer import build_model  # noqa: E402
from dstrain.train.trainer import Trainer  # noqa: E402
from tests.hf_models import (  # noqa: E402
    dequantise_block,
    fuse_experts,
    hf_loss,
    hf_model,
    save,
    save_fp8,
)
from tests.unit.tiny import tiny_args  # noqa: E402

BLOCK = 32  # FP8 blocks: 96 x 64 and 40 x 64 weights have partial ones
# The first step's loss against transformers' (summed in fp64), relative. From fp32 and bf16
# checkpoints: measured 9.5e-9 (V3 fp32) and 2.7e-8 (V3 bf16, V2 fp32) on AVX512 and AVX2
# kernels, any thread count; bound 2e-7 (the loss's fp32 spacing is 7.6e-8 of it: room for a
# CPU that rounds the last step once more).
LOSS_RTOL = 2e-7
# From FP8, against the unquantised model: its quantisation error alone, measured 2.6e-5 on
# AVX512 and AVX2 kernels; bound 1e-4.
FP8_RTOL = 1e-4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    import sysconfig
    from pathlib import Path

    root = tmp_path_factory.mktemp("init_from")
    text = (Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py").read_text()
    (root / "corpus.txt").write_text(text * 3)
    return root


def _trainer(root, folder, *more):
    overrides = [
        f"model.init_from={folder}",
        f"data.source={root / 'corpus.txt'}",
        f"data.cache_dir={root / 'cache'}",
        f"run.root={root / 'runs'}",
        f"run.name={folder.name}",
        "train.seq_len=32",
        "train.micro_batch_size=4",
        "train.global_batch_size=8",
        "checkpoint.enable=false",
        "metrics.tensorboard=false",
        *more,
    ]
    return Trainer(load_config(None, overrides).config)


def _first_step(trainer):
    """(our first-step loss, the batches it saw)."""
    position = trainer.loader.sample_position
    batches = trainer.loader.next_step()
    trainer.loader.sample_position = position
    return trainer._one_step().loss.item(), batches


@pytest.mark.parametrize(
    "kind, dtype", [("v3", torch.float32), ("v3", torch.bfloat16), ("v2", torch.float32)]
)
def test_the_first_step_loss_is_transformers(corpus, tmp_path, kind, dtype):
    hf = hf_model(kind)
    folder = save(hf, tmp_path / f"{kind}-{str(dtype)[6:]}", dtype)
    ours, batches = _first_step(_trainer(corpus, folder))
    reference = hf_loss(hf.to(dtype).to(torch.float32), batches)
    gap = abs(ours - reference) / reference
    print(f"init_from {kind} {dtype}: ours {ours:.6f}, transformers {reference:.6f} ({gap:.1e})")
    assert gap <= LOSS_RTOL, (ours, reference, gap)


def checkpoint_tensors(folder, block: int | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as transformers wrote them (an FP8 weight dequantised with its
    block scales, in fp32 as the loader keeps it)."""
    from safetensors.torch import load_file

    raw = {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}
    out = {}
    for name, tensor in raw.items():
        if name.endswith("_scale_inv"):
            continue
        if f"{name}_scale_inv" in raw:
            tensor = dequantise_block(tensor, raw[f"{name}_scale_inv"], block).float()
        out[name] = tensor
    return out


def loaded_as_checkpoint(state: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
    """Our state dict under the checkpoint's names (the exporter's map, which transformers itself
    checks in the export tests), with MTP's copies of the embedding and head."""
    return with_mtp_copies(to_hf(state, args), args)


def assert_bit_for_bit(ours: dict[str, torch.Tensor], files: dict[str, torch.Tensor], args):
    """Every tensor of the checkpoint is loaded exactly; ours may add only V2's zero routing
    biases (V2 has none; the balancing bias starts at zero)."""
    extra = set(ours) - set(files)
    assert all(k.endswith("e_score_correction_bias") for k in extra), sorted(extra)
    assert all(not ours[k].any() for k in extra), sorted(extra)
    assert set(files) <= set(ours), sorted(set(files) - set(ours))
    unequal = [k for k in files if not torch.equal(ours[k], files[k].to(ours[k].dtype))]
    assert not unequal, unequal


@pytest.mark.parametrize("kind, fp8", [("v3", False), ("v2", False), ("v3", True)])
def test_every_loaded_tensor_is_the_checkpoints_bit_for_bit(corpus, tmp_path, kind, fp8):
    """Not a loss (a swapped half of q_b_proj moves the first loss by 4e-6, zeroed routing
    biases by 1e-5): every tensor, against the files transformers wrote."""
    hf = hf_model(kind)
    name = f"{kind}-{'fp8' if fp8 else 'fp32'}-bits"
    folder = save_fp8(hf, tmp_path / name, BLOCK) if fp8 else save(hf, tmp_path / name)
    model = _trainer(corpus, folder).model
    ours = loaded_as_checkpoint(model.state_dict(), model.args)
    assert_bit_for_bit(ours, checkpoint_tensors(folder, BLOCK), model.args)


def test_fused_experts_load_bit_for_bit(corpus, tmp_path):
    """A checkpoint in transformers' fused expert layout (gate_up_proj [E, 2F, D], down_proj
    [E, D, F]): each expert's slices read out of the fused tensors, as the per-expert files'."""
    from safetensors.torch import load_file, save_file

    hf = hf_model("v3")
    per_expert = save(hf, tmp_path / "per-expert")
    fused = save(hf, tmp_path / "fused")
    (file,) = fused.glob("*.safetensors")
    save_file(fuse_experts(load_file(str(file))), str(file), metadata={"format": "pt"})
    model = _trainer(corpus, fused).model
    ours = loaded_as_checkpoint(model.state_dict(), model.args)
    assert_bit_for_bit(ours, checkpoint_tensors(per_expert, BLOCK), model.args)


def test_fp8_dequantises_exactly_and_costs_its_quantisation_error(corpus, tmp_path):
    hf = hf_model("v3")
    folder = save_fp8(hf, tmp_path / "v3-fp8", BLOCK)
    checkpoint = HFCheckpoint(folder)
    assert checkpoint.block == BLOCK
    name = "model.layers.1.mlp.experts.3.gate_proj.weight"  # 24 x 64: partial row blocks
    q_file = checkpoint.tensors[name].file
    from safetensors.torch import load_file

    raw = load_file(str(q_file))
    expected = dequantise_block(raw[name], raw[name + "_scale_inv"], BLOCK)
    # Any box of it, including one that starts inside a block and ends in a partial one.
    part = checkpoint.read(name, (slice(5, 24), slice(17, 64)))
    assert torch.equal(part.double(), expected[5:24, 17:64].float().double())
    # A box in the third row block and the second column block (a TP or FSDP shard's): its
    # scales are those of its own blocks.
    dense = "model.layers.0.mlp.gate_proj.weight"  # 96 x 64: three row blocks
    whole = dequantise_block(raw[dense], raw[dense + "_scale_inv"], BLOCK)
    part = checkpoint.read(dense, (slice(70, 96), slice(40, 64)))
    assert torch.equal(part.double(), whole[70:96, 40:64].float().double())
    fused = hf.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]  # [E, 2F, D] in memory
    original = fused[3, : fused.size(1) // 2].double()
    error = (expected - original).abs().max() / original.abs().max()
    assert error <= 2**-4  # e4m3: 3 mantissa bits, relative to the block's largest element
    ours, batches = _first_step(_trainer(corpus, folder))
    reference = hf_loss(hf, batches)
    gap = abs(ours - reference) / reference
    print(
        f"init_from fp8: ours {ours:.6f}, transformers (unquantised) {reference:.6f}, "
        f"rel {gap:.1e}; max weight error {error:.1e} of the block max"
    )
    assert gap <= FP8_RTOL, (ours, reference, gap)


def test_an_mtp_layer_with_its_own_embedding_is_refused_naming_the_rows(corpus, tmp_path):
    """dstrain's MTP shares the main model's embedding, as DeepSeek-V3's does: a checkpoint whose
    MTP copy differs is refused, naming how many rows differ and the first."""
    from safetensors.torch import load_file, save_file

    args = tiny_args(vocab_size=2048)  # the corpus's tokenizer
    folder = tmp_path / "own-embedding"
    save_hf_checkpoint(build_model(args).state_dict(), args, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    copy = f"model.layers.{args.num_layers}.embed_tokens.weight"
    tensors[copy][[7, 300]] += 1.0
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError) as caught:
        _trainer(corpus, folder)
    assert f"{copy} differs from model.embed_tokens.weight" in caught.value.message
    assert "(2 of the 2048 rows read here, first row 7)" in caught.value.message


def test_bad_checkpoints_are_one_clear_error(corpus, tmp_path):
    from safetensors.torch import load_file, save_file

    hf = hf_model("v3")
    folder = save(hf, tmp_path / "broken")
    (file,) = folder.glob("*.safetensors")
    tensors = load_file(str(file))
    name = "model.layers.2.self_attn.o_proj.weight"
    cases = {
        "missing": ({k: v for k, v in tensors.items() if k != name}, name),
        "extra": ({**tensors, "model.layers.9.mlp.gate.weight": tensors[name].clone()}, "layers.9"),
        "shape": ({**tensors, name: tensors[name][:, :-1].contiguous()}, "[64, 63] here"),
    }
    for case, (changed, mention) in cases.items():
        save_file(changed, str(file), metadata={"format": "pt"})
        with pytest.raises(UserError) as caught:
            _trainer(corpus, folder)
        assert mention in caught.value.message, (case, caught.value.message)
        assert caught.value.fix, case
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(UserError) as caught:  # the architecture asks for an MTP layer
        _trainer(corpus, folder, "model.num_mtp_modules=1")
    assert "model.num_mtp_modules=0" in caught.value.fix
