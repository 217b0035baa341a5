"""Kimi K3's MXFP4 routed experts (compressed-tensors' `mxfp4-pack-quantized`) in both directions, by compressed-tensors
itself: `decode_mxfp4` (import) and `encode_mxfp4` (export), one expert weight at a time.

The format: `weight_packed` uint8 `[out, in / 2]`, two E2M1 codes a byte (the even input column in the low nibble;
bit 3 of a code is its sign), and `weight_scale` uint8 `[out, in / 32]`, one E8M0 exponent (`2 ** (e - 127)`) per 32
inputs. Every MXFP4 value is a bfloat16 value, so decoding is exact.

Encoding picks each block's scale as compressed-tensors does when it quantises a weight (its `calculate_qparams` of
the block's min and max: a power of two from the largest magnitude, `generate_mx_scales`) and packs the
codes with its `MXFP4PackedCompressor.compress`, so MXFP4 that compressed-tensors made from weights (as a release is
made) comes back byte for byte. One correction: a code of -0 (a weight that rounded to zero from below) decodes to
-0.0, which the compressor packs as +0 (its rounding, `cast_to_fp4`, takes the sign from `torch.sign`, 0 for -0.0;
its GPU kernel tests `x < 0`); the sign of each -0.0 is put back.
What values cannot tell: a block whose stored scale is larger than the one compressed-tensors picks for its values
(every code at most 3, all zero included, as another encoder may write) is written with compressed-tensors' scale:
the same values, other bytes. Every encoded tensor is decoded again and compared with the weight bit for bit.
"""

import re

import torch

from .sources import TensorRead

GROUP_SIZE = 32
"""Inputs per E8M0 scale (MXFP4's block)."""


def _scheme():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="float", strategy="group", group_size=GROUP_SIZE, symmetric=True,
                            scale_dtype=torch.uint8)
    return QuantizationScheme(targets=["Linear"], weights=args)


def decode_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One MXFP4 weight `[out, in]`, bfloat16 (which holds every MXFP4 value exactly), from its `weight_packed`
    `[out, in / 2]` and `weight_scale` `[out, in / 32]` (uint8 each), by compressed-tensors' own decompressor.

    Raises:
        ImportError: compressed-tensors is not installed.
    """
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor

    state = MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale}, _scheme())
    return state["weight"].to(torch.bfloat16)


def encode_mxfp4(weight: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weight_packed, weight_scale)` (uint8 `[out, in / 2]`, `[out, in / 32]`) of the 2-D float `weight` `[out, in]`
    (bf16 or fp32; `in` divisible by 32), by compressed-tensors' scale choice and compressor (see the module
    docstring), checked: decoded again, the values equal `weight`'s bit for bit (-0.0 included).

    Raises:
        ValueError: one line naming tensor `name`: a shape MXFP4 cannot hold, or a value that is not exactly an MXFP4
            value (the weights changed since they were MXFP4: fine-tuned); nothing is rounded.
        ImportError: compressed-tensors is not installed.
    """
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    if weight.dim() != 2 or weight.shape[1] % GROUP_SIZE or not weight.is_floating_point():
        raise ValueError(f"{name}: MXFP4 holds 2-D float weights of an input dim divisible by {GROUP_SIZE}, got "
                         f"{tuple(weight.shape)} {str(weight.dtype).removeprefix('torch.')}")
    weight = weight.contiguous()
    scheme = _scheme()
    blocks = weight.unflatten(-1, (weight.shape[1] // GROUP_SIZE, GROUP_SIZE))
    scales, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights)
    state = MXFP4PackedCompressor.compress({"weight": weight, "weight_scale": scales}, scheme)
    negative_zero = ((weight == 0) & torch.signbit(weight)).to(torch.uint8)
    packed = state["weight_packed"] | (negative_zero[:, 0::2] << 3) | (negative_zero[:, 1::2] << 7)
    scale = state["weight_scale"].to(torch.uint8)
    decoded = decode_mxfp4(packed, scale).to(weight.dtype)
    differ = (decoded.view(torch.uint8) != weight.view(torch.uint8)).unflatten(-1, (weight.shape[1], -1)).any(-1)
    if differ.any():
        row, column = differ.nonzero()[0].tolist()
        count = int(differ.sum())
        raise ValueError(f"{name} is not MXFP4: {count} of its {weight.numel()} values are not MXFP4 values (e.g. "
                         f"{weight[row, column].item():.6g} at [{row}, {column}]): the experts changed since they were "
                         "imported from MXFP4 (fine-tuned?); export them unquantised with --experts unquantized "
                         "(experts='unquantized')")
    return packed, scale


_EXPERT = re.compile(r"model\.layers\.\d+\.block_sparse_moe\.experts\.\d+\.w[123]\.weight$")
"""A routed expert's weight in K3's text layout (the tensors K3's release stores as MXFP4)."""


def check_mxfp4_shapes(tensors: dict) -> None:
    """Before anything is written: every routed expert of K3's text-layout `tensors` (real or meta) is 2-D with an
    input dim divisible by 32. Raises `ValueError` naming those that are not."""
    bad = sorted(f"{name} {tuple(t.shape)}" for name, t in tensors.items()
                 if _EXPERT.match(name) and (t.dim() != 2 or t.shape[1] % GROUP_SIZE))
    if bad:
        raise ValueError(f"routed experts MXFP4 cannot hold (2-D, input dim divisible by {GROUP_SIZE}): "
                         f"{', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}")


def mxfp4_state(tensors: dict) -> dict:
    """K3's text-layout `tensors` with each routed expert `NAME.weight` as `NAME.weight_packed` and
    `NAME.weight_scale` (`encode_mxfp4`), in place of it; the other tensors as they are. Raises `ValueError` naming
    an expert whose values are not MXFP4 values."""
    out = {}
    for name, tensor in tensors.items():
        if _EXPERT.match(name):
            base = name.removesuffix(".weight")
            out[base + ".weight_packed"], out[base + ".weight_scale"] = encode_mxfp4(tensor, name)
        else:
            out[name] = tensor
    return out


def mxfp4_reads(reads: dict[str, TensorRead]) -> dict[str, TensorRead]:
    """`mxfp4_state` of lazy reads (a streamed export): each routed expert's pair read as one expert is encoded
    (`encode_mxfp4` of the expert's read, the last expert's pair kept for its other half), one expert in memory at a
    time. A value that is not an MXFP4 value raises `ValueError` (naming the expert) when the pair is read."""
    last = {}

    def pair(name: str, read: TensorRead) -> tuple[torch.Tensor, torch.Tensor]:
        if last.get("name") != name:
            last.clear()
            last.update(name=name, pair=encode_mxfp4(read.rows(), name))
        return last["pair"]

    out = {}
    for name, read in reads.items():
        if not _EXPERT.match(name):
            out[name] = read
            continue
        base, (rows, columns) = name.removesuffix(".weight"), read.shape
        out[base + ".weight_packed"] = TensorRead.whole((rows, columns // 2), torch.uint8, read.where,
                                                        lambda n=name, r=read: pair(n, r)[0])
        out[base + ".weight_scale"] = TensorRead.whole((rows, columns // GROUP_SIZE), torch.uint8, read.where,
                                                       lambda n=name, r=read: pair(n, r)[1])
    return out


__all__ = ["GROUP_SIZE", "check_mxfp4_shapes", "decode_mxfp4", "encode_mxfp4", "mxfp4_reads", "mxfp4_state"]
