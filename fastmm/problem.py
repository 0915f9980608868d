"""What the dispatcher decides from: the device's facts and the problem's shape, strides,
alignment and precision. Plain frozen dataclasses (hashable: a Problem is the plan-cache key)."""
from __future__ import annotations

from dataclasses import dataclass, replace

PRECISIONS = ("ieee", "tf32", "tf32x3")

# A fused epilogue (C = alpha * A @ B + beta * D) by the shape of D in the product's (M, N)
# coordinates. A kernel may apply a D that is one vector (F.linear's bias) to its accumulators as
# it stores them, with a value or two a thread; a D of any strides is read per output.
EPILOGUE_NONE = ""
EPILOGUE_D = "d"  # D of any strides
EPILOGUE_BIAS_N = "bias_n"  # D the same for every row (stride 0 along M): a bias over C's columns
EPILOGUE_BIAS_M = "bias_m"  # D the same for every column (stride 0 along N): a bias over C's rows


def epilogue_form(d_strides: tuple[int, int]) -> str:
    """The epilogue form of D with element strides (along M, along N) after broadcasting to
    (M, N). A D with both strides 0 (one value) counts as a bias over the columns."""
    sm, sn = d_strides
    if sm == 0:
        return EPILOGUE_BIAS_N
    if sn == 0:
        return EPILOGUE_BIAS_M
    return EPILOGUE_D


def dram_tbps(memory_clock_khz: int, bus_width_bits: int) -> float:
    """Peak DRAM bandwidth in TB/s from the driver's memory clock and bus width: two transfers a
    clock (double data rate) over the whole bus."""
    return 2.0 * memory_clock_khz * 1e3 * bus_width_bits / 8 / 1e12


#: What the driver reports (memory clock in kHz, bus width in bits) for the H200 (nvidia-smi: a
#: 3201 MHz memory clock; 6144 bits: 4.92 TB/s) and the H100 80GB SXM (2619 MHz, 5120 bits: 3.35
#: TB/s; NOTES run 46).
H200_MEMORY = (3_201_000, 6144)
H100_MEMORY = (2_619_000, 5120)
H200_DRAM_TBPS = dram_tbps(*H200_MEMORY)


@dataclass(frozen=True)
class DeviceFacts:
    """The properties of one GPU the planner needs. Read from the driver by
    :func:`fastmm.runtime.device.device_facts`, or made up by :meth:`simulated` for tests."""

    index: int
    name: str
    cc: tuple[int, int]
    sm_count: int
    smem_per_block_optin: int
    smem_per_sm: int
    l2_bytes: int
    simulated: bool = False
    #: DRAM bandwidth in TB/s at the driver's peak memory clock (:func:`dram_tbps`); 0.0 where
    #: not known. Two parts of one arch can differ here alone (H100 80GB: 3.35, H200: 4.92), and
    #: memory-bound choices (a staging copy beside a product) move with it.
    dram_tbps: float = 0.0

    def dram_over(self, part_tbps: float) -> float:
        """This device's DRAM bandwidth over another part's (``part_tbps``, its driver peak): what
        a figure measured on that part scales by here. 1.0 where either is not known."""
        return self.dram_tbps / part_tbps if self.dram_tbps > 0 and part_tbps > 0 else 1.0

    @property
    def arch(self) -> str:
        return f"sm_{self.cc[0]}{self.cc[1]}"

    @classmethod
    def simulated_device(cls, arch: str, index: int = 0) -> "DeviceFacts":
        """A device with the published limits of a real part of that arch (for CPU-side tests and
        for showing plans where there is no GPU)."""
        table = {  # (memory clock in kHz, bus width in bits: the driver's, for dram_tbps)
            "sm_75": ("simulated T4", (7, 5), 40, 64 * 1024, 64 * 1024, 4 << 20, (5_001_000, 256)),
            "sm_80": ("simulated A100", (8, 0), 108, 163 * 1024, 164 * 1024, 40 << 20, (1_215_000, 5120)),
            "sm_86": ("simulated RTX A6000", (8, 6), 84, 99 * 1024, 100 * 1024, 6 << 20, (8_001_000, 384)),
            "sm_89": ("simulated L40S", (8, 9), 142, 99 * 1024, 100 * 1024, 96 << 20, (9_001_000, 384)),
            "sm_90": ("simulated H200", (9, 0), 132, 227 * 1024, 228 * 1024, 60 << 20, H200_MEMORY),
        }
        name, cc, sms, optin, per_sm, l2, memory = table[arch]
        return cls(index, name, cc, sms, optin, per_sm, l2, simulated=True, dram_tbps=dram_tbps(*memory))

    @classmethod
    def simulated_h100(cls, index: int = 0) -> "DeviceFacts":
        """An H100 80GB SXM: the H200's arch and SMs with 50 MiB of L2 and 3.35 TB/s of DRAM (its
        driver reports a 2619 MHz memory clock and a 5120-bit bus)."""
        return replace(cls.simulated_device("sm_90", index), name="simulated H100", l2_bytes=50 << 20,
                       dram_tbps=dram_tbps(*H100_MEMORY))


@dataclass(frozen=True)
class Problem:
    """C[z] = A[z] @ B[z] for z < batch_total, each operand described by element strides.

    The batch is at most two broadcast dimensions (z = z0 * batch_inner + z1); ``*_batch_strides``
    are the strides of (z0, z1). ``*_align`` is the largest of 16/8/4/1 bytes dividing the
    operand's data pointer.
    """

    M: int
    N: int
    K: int
    a_strides: tuple[int, int]  # (along M, along K)
    b_strides: tuple[int, int]  # (along K, along N)
    c_strides: tuple[int, int]  # (along M, along N)
    batch_inner: int = 1
    batch_total: int = 1
    a_batch_strides: tuple[int, int] = (0, 0)
    b_batch_strides: tuple[int, int] = (0, 0)
    c_batch_strides: tuple[int, int] = (0, 0)
    a_align: int = 16
    b_align: int = 16
    c_align: int = 16
    precision: str = "ieee"
    # The operand's rows are readable (zero-padded) up to the next multiple of 4 floats: set on
    # the launch problem of a staged plan, so 16-byte copies may run past N (or K).
    a_padded: bool = False
    b_padded: bool = False
    # The kernel finishes each output as alpha * product + beta * D (cuda_src/common.cuh, the
    # fused epilogue): D, alpha and beta are per-call arguments, like the operands' pointers;
    # the form says what D's strides are (EPILOGUE_*; "": no epilogue).
    epilogue: str = EPILOGUE_NONE

    @classmethod
    def dense(cls, M: int, N: int, K: int, precision: str = "ieee", batch: int = 1,
              a_t: bool = False, b_t: bool = False, align: int = 16) -> "Problem":
        """Contiguous (optionally transposed-view) operands: handy for tests and explain text."""
        a = (1, M) if a_t else (K, 1)
        b = (1, K) if b_t else (N, 1)
        return cls(M, N, K, a, b, (N, 1), batch, batch, (0, M * K), (0, K * N), (0, M * N),
                   align, align, align, precision)

    def layout_of(self, which: str) -> str:
        s = {"a": self.a_strides, "b": self.b_strides, "c": self.c_strides}[which]
        if s[1] == 1:
            return "row-major"
        if s[0] == 1:
            return "column-major"
        return "strided"


def transposed(p: Problem) -> Problem:
    """The problem C^T = B^T A^T: the same memory, with the roles of A and B exchanged."""
    return replace(p, M=p.N, N=p.M, a_strides=p.b_strides[::-1], b_strides=p.a_strides[::-1],
                   c_strides=p.c_strides[::-1], a_batch_strides=p.b_batch_strides, b_batch_strides=p.a_batch_strides,
                   a_align=p.b_align, b_align=p.a_align, a_padded=p.b_padded, b_padded=p.a_padded,
                   epilogue=TRANSPOSED_EPILOGUE.get(p.epilogue, p.epilogue))


#: The form of D^T, for the problem computed transposed (a bias over columns becomes one over rows).
TRANSPOSED_EPILOGUE = {EPILOGUE_BIAS_N: EPILOGUE_BIAS_M, EPILOGUE_BIAS_M: EPILOGUE_BIAS_N}
