"""What a measurement ran on, named the same way in traces, benchmarks, sweeps and profiles."""
from __future__ import annotations

import platform
from typing import Any, Optional, Union

import torch


def gpu_name(device: Union[str, torch.device, None]) -> Optional[str]:
    """The GPU's marketing name ("NVIDIA H200") for a CUDA device, else None."""
    dev = torch.device(device if device is not None else "cpu")
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else None


def device_name(device: Union[str, torch.device, None]) -> str:
    """The GPU's name, or "cpu (<processor>)"."""
    return gpu_name(device) or f"cpu ({platform.processor() or platform.machine()})"


def machine_info(device: Union[str, torch.device, None]) -> dict[str, Any]:
    """platform, python, torch (and triton where installed) versions; on CUDA the GPU's name, the
    8-bit formats' activation quantizer ("fused" or "torch") and the kernel of fp16 W4 products
    (hierviz.machine.w4_fp16_kernel: which of the two kernels HIERVIZ_W4_CUDA gives which weights)."""
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "torch": torch.__version__}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        pass
    gpu = gpu_name(device)
    if gpu:
        from hierviz.quant import act_quant
        info["gpu"] = gpu
        # the 8-bit formats' activation quantizer changes their step time (hierviz.measure.cost_model)
        info["activation_quantizer"] = act_quant.name_on(torch.device(device))
        info["w4_fp16_kernel"] = w4_fp16_kernel(torch.device(device))
    return info


def w4_fp16_kernel(device: torch.device) -> str:
    """Which kernel runs fp16 W4 products on `device`: "cuda_mma", "triton", with
    HIERVIZ_W4_CUDA=target "cuda_mma for the target, triton for the rest", with auto the weights
    the timings gave to each (w4_verdicts.kernel_summary)."""
    from hierviz.quant import kernel_guard
    from hierviz.quant.w4_verdicts import CUDA_VARIANT, kernel_summary
    mode = kernel_guard.cuda_mode()
    if mode == "off" or CUDA_VARIANT not in kernel_guard.fast_variants(device, torch.float16):
        return "triton"
    if mode == "auto":
        return kernel_summary()
    return f"{CUDA_VARIANT} for the target, triton for the rest" if mode == "target" else CUDA_VARIANT


KERNEL_PER_KIND = "kernel chosen per weight kind"


def formats_in_words(description: str, machine: Optional[dict[str, Any]]) -> str:
    """A record's format description as a reader should see it: "kernel triton" names the kernel
    family its W4 models were built with, so where its machine ran some fp16 W4 products on the
    CUDA MMA kernel (`w4_fp16_kernel`, which names the weights) it reads KERNEL_PER_KIND."""
    fp16 = (machine or {}).get("w4_fp16_kernel")
    if isinstance(fp16, str) and fp16 and fp16 != "triton":
        return description.replace("kernel triton", KERNEL_PER_KIND)
    return description

