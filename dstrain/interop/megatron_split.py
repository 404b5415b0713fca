"""Megatron-Core's per-rank layer split, as its own arithmetic computes it: which transformer
layers each pipeline rank and virtual stage builds from --num-layers, the pipeline size, the
virtual size (any of its spellings), --decoder-first/last-pipeline-num-layers and the
--account-for-embedding/loss-in-pipeline-split switches, and what Megatron refuses on the way.

Megatron-Core's arithmetic, read at NVIDIA/Megatron-LM megatron/training/arguments.py
(validate_args), megatron/core/transformer/transformer_config.py (TransformerConfig.
__post_init__) and megatron/core/transformer/transformer_block.py (get_num_layers_to_build).
--decoder-first/last-pipeline-num-layers become num_layers_in_first/last_pipeline_stage:
counts of a *physical* pipeline rank, whose layers the virtual size then divides into chunks.
"""

from typing import Any

from dstrain.config.findings import Finding, error


def pipeline_split(
    num_layers: int, pp: int, split: dict[str, Any]
) -> tuple[list[int] | None, int, list[Finding]]:
    """The transformer layers Megatron-Core builds on each virtual stage, in schedule order
    (stage s is model chunk s // pp of pipeline rank s % pp), the virtual size, and what Megatron
    refuses on the way. `split` holds the flags (argparse dests) that shape the split."""
    vp, found = _virtual_size(num_layers, pp, split)
    if found:
        return None, vp, found
    first = split.get("decoder_first_pipeline_num_layers")
    last = split.get("decoder_last_pipeline_num_layers")
    embedding = split.get("account_for_embedding_in_pipeline_split") is True
    loss = split.get("account_for_loss_in_pipeline_split") is True
    if first is not None or last is not None:
        if embedding or loss:  # TransformerConfig.__post_init__
            return (
                None,
                vp,
                [
                    error(
                        "decoder_first_pipeline_num_layers",
                        "--decoder-first/last-pipeline-num-layers with "
                        "--account-for-embedding/loss-in-"
                        "pipeline-split: Megatron-Core raises `num_layers_in_first_pipeline_stage "
                        "and "
                        "num_layers_in_last_pipeline_stage cannot be set at the same time with "
                        "account_for_embedding_in_pipeline_split and "
                        "account_for_loss_in_pipeline_split`",
                        "keep one way of evening out the end stages",
                    )
                ],
            )
        ranks, found = _uneven_ranks(num_layers, pp, vp, first, last)
    else:
        ranks, found = _even_ranks(num_layers + embedding + loss, pp, vp)
    if ranks is None:
        return None, vp, found
    # get_num_layers_to_build: every chunk of a rank holds rank_layers // vp; the embedding
    # (loss) takes one layer's place on the first (last) virtual stage.
    chunks = [ranks[s % pp] // vp for s in range(pp * vp)]
    chunks[0] -= embedding
    chunks[-1] -= loss
    if min(chunks) < 0:
        return (
            None,
            vp,
            [
                error(
                    "account_for_embedding_in_pipeline_split",
                    "an end stage is left with fewer than 0 layers: Megatron-Core asserts `Not "
                    "enough "
                    "layers in the first (last) virtual pipeline stage`",
                    "use more layers per stage, or drop "
                    "--account-for-embedding/loss-in-pipeline-split",
                )
            ],
        )
    return chunks, vp, []


def _virtual_size(num_layers: int, pp: int, split: dict[str, Any]) -> tuple[int, list[Finding]]:
    """validate_args: the virtual size from --num-virtual-stages-per-pipeline-rank (or the
    config name virtual_pipeline_model_parallel_size of NeMo / Megatron-Bridge), or derived from
    --num-layers-per-virtual-pipeline-stage as (layers / pp) / it."""
    per_chunk = split.get("num_layers_per_virtual_pipeline_stage")
    stages = split.get("num_virtual_stages_per_pipeline_rank") or split.get(
        "virtual_pipeline_model_parallel_size"
    )
    if per_chunk is None:
        return (stages if isinstance(stages, int) and stages > 0 else 1), []
    key = "num_layers_per_virtual_pipeline_stage"
    if stages is not None:
        return 1, [
            error(
                key,
                "Megatron asserts `num_layers_per_virtual_pipeline_stage and "
                "num_virtual_stages_per_pipeline_rank cannot be set at the same time`",
                "keep one of the two",
            )
        ]
    if {"decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"} & set(split):
        return 1, [
            error(
                key,
                "Megatron asserts `please use --num-virtual-stages-per-pipeline-rank to specify "
                "virtual pipeline parallel degree when enable uneven pipeline parallelism`",
                "give --num-virtual-stages-per-pipeline-rank instead",
            )
        ]
    layers = num_layers + sum(
        split.get(f"account_for_{end}_in_pipeline_split") is True for end in ("embedding", "loss")
    )
    if layers % pp or (layers // pp) % per_chunk:
        return 1, [
            error(
                key,
                f"{layers} layers over pipeline size {pp} do not make whole chunks of {per_chunk}: "
                "Megatron asserts `number of layers of the model must be divisible pipeline model "
                "parallel size` and `number of layers per pipeline stage must be divisible number "
                "of "
                "layers per virtual pipeline stage`",
                "choose layers per virtual stage that divide the layers of one pipeline rank",
            )
        ]
    return layers // pp // per_chunk, []


def _even_ranks(layers: int, pp: int, vp: int) -> tuple[list[int] | None, list[Finding]]:
    """Layers (counting the embedding and loss when accounted for) split evenly over the pipeline
    ranks: validate_args' `Number of layers should be divisible by the pipeline-model-parallel
    size`, then TransformerConfig's `number of layers on each pipeline rank ... must be divisible
    by virtual pipeline parallel degree`."""
    if layers % pp:
        return None, [
            error(
                "pipeline_model_parallel_size",
                f"{layers} layers do not divide over pipeline size {pp}: Megatron asserts `Number "
                "of "
                "layers should be divisible by the pipeline-model-parallel size`",
                "choose a pipeline size that divides the layers, or give the end stages their own "
                "counts with --decoder-first/last-pipeline-num-layers",
            )
        ]
    if (layers // pp) % vp:
        return None, [
            error(
                "num_virtual_stages_per_pipeline_rank",
                f"{layers // pp} layers on each pipeline rank do not divide into {vp} virtual "
                "stages: "
                "Megatron-Core raises `number of layers on each pipeline rank ... must be "
                "divisible "
                "by virtual pipeline parallel degree`",
                "choose a virtual size that divides the layers of one pipeline rank",
            )
        ]
    return [layers // pp] * pp, []


def _uneven_ranks(
    num_layers: int, pp: int, vp: int, first: Any, last: Any
) -> tuple[list[int] | None, list[Finding]]:
    """--decoder-first/last-pipeline-num-layers N: that physical rank holds N layers and the
    middle ranks split the rest evenly; the virtual size divides each rank's count
    (TransformerConfig.__post_init__; get_num_layers_to_build)."""
    ends = {"first": first, "last": last}
    for end, count in ends.items():
        if count is not None and count <= 0:
            return None, [
                error(
                    f"decoder_{end}_pipeline_num_layers",
                    f"Megatron-Core raises `num_layers_in_{end}_pipeline_stage must be larger "
                    f"than 0` (given {count})",
                    f"leave --decoder-{end}-pipeline-num-layers out for an even split",
                )
            ]
    middle = pp - sum(n is not None for n in ends.values())
    rest = num_layers - sum(n for n in ends.values() if n is not None)
    if rest < 0 or (middle > 0 and rest % middle) or bool(middle) != bool(rest):
        return None, [
            error(
                "decoder_first_pipeline_num_layers",
                f"{num_layers} layers less {num_layers - rest} on the end stage(s) leave {rest} "
                "for "
                f"the {middle} middle pipeline rank(s): Megatron-Core raises `number of layers at "
                "middle stage ... must be divisible by the middle pipeline model parallel size` "
                "(or, when no layers or no middle ranks are left, `Mismatch: N middle layers "
                "remaining but M middle PP stages available`)",
                "choose first/last stage layer counts that leave a multiple of the middle ranks",
            )
        ]
    share = rest // middle if middle else 0
    ranks = [share] * pp
    for end, count in ends.items():
        if count is None:
            continue
        if count % vp:
            return None, [
                error(
                    f"decoder_{end}_pipeline_num_layers",
                    f"{count} layers on the {end} pipeline rank do not divide into {vp} virtual "
                    f"stages: Megatron-Core raises `number of layers at {end} stage: {count} must "
                    "be "
                    f"divisible by virtual pipeline parallel degree {vp}` (the count is the "
                    "physical "
                    "rank's, split over its model chunks)",
                    f"give the {end} rank a multiple of {vp} layers",
                )
            ]
        ranks[0 if end == "first" else -1] = count
    if middle and share % vp:
        return None, [
            error(
                "num_virtual_stages_per_pipeline_rank",
                f"{share} layers on each middle pipeline rank do not divide into {vp} virtual "
                "stages: "
                "Megatron-Core raises `number of layers on each middle pipeline rank ... must be "
                "divisible by virtual pipeline parallel degree`",
                "choose end-stage counts that leave each middle rank a multiple of the virtual "
                "size",
            )
        ]
    return ranks, []
