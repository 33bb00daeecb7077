"""A stand-in for triton 3.6's CUDA launcher of a kernel that takes tensor descriptors, for CPU tests of
lmsys.kernels.plans.Expanded: built as that release's driver builds it (triton/backends/nvidia/driver.py),
with the names plans looks for, and an encoder that records what it encodes instead of calling the driver.

  Launcher.__call__(gridX, gridY, gridZ, stream, function, *args): as CudaLauncher's, the cooperative-grid
      and PDL flags and the two scratch buffers (none here) put before `args`, then `self.launch`;
  wrap_handle_tensordesc(launcher, signature, metas): `launch`, a closure `inner` that puts each tensor
      descriptor argument's expansion (make_tensordesc_arg) in its place and calls `launcher`, the raw one;
  make_tensordesc_arg(desc, meta): ["map" of the address, block and swizzle, *shape, *strides], each
      address it encodes appended to ENCODED.
"""

_BASE_ARGS_FORMAT_LEN = 13  # grid (3), stream, function, two flags, two scratch buffers, the kernel's
#                             metadata, launch metadata and the two hooks
ENCODED: list = []


def make_tensordesc_arg(arg, metadata):
    address = arg.base.data_ptr()
    ENCODED.append(address)
    return [("map", address, tuple(arg.block_shape), metadata["swizzle"]), *arg.shape, *arg.strides]


def wrap_handle_tensordesc(launcher, signature, tensordesc_meta):
    tensordesc_indices = {i for i, sig in enumerate(signature.values()) if str(sig).startswith("tensordesc")}

    def inner(*args):
        final_args = list(args[:_BASE_ARGS_FORMAT_LEN])
        meta_index = 0
        for i, arg in enumerate(args[_BASE_ARGS_FORMAT_LEN:]):
            if i in tensordesc_indices:
                final_args.extend(make_tensordesc_arg(arg, tensordesc_meta[meta_index]))
                meta_index += 1
            else:
                final_args.append(arg)
        return launcher(*final_args)

    return inner


class Launcher:
    def __init__(self, raw, signature: dict, metas: list, scratch: int = 0):
        self.launch = wrap_handle_tensordesc(raw, signature, metas)
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        scratch = None  # triton allocates global_scratch_size bytes a program here; none in these tests
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    scratch, None, *args)
