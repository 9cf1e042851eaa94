"""The engine dtype follows the CPU's bf16 instructions, read from /proc/cpuinfo."""

from __future__ import annotations

from cachegen import cpu

AMX = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"})
AVX512_BF16 = frozenset({"avx2", "avx512f", "avx512_bf16"})
AVX512 = frozenset({"avx2", "avx512f", "avx512bw", "avx512_vnni"})
AVX2 = frozenset({"avx2", "fma"})


def test_flags_are_read_from_the_first_processor(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 fma\n\n"
        "processor\t: 1\nflags\t\t: fpu avx2 fma avx512f\n"
    )
    assert cpu.cpu_flags(info) == frozenset({"fpu", "avx2", "fma"})
    assert cpu.cpu_fields(info)["model name"] == "AMD EPYC"
    assert cpu.cpu_flags(tmp_path / "missing") == frozenset()


def test_bf16_engines_only_where_bf16_is_native(monkeypatch):
    monkeypatch.delenv(cpu.DTYPE_ENV, raising=False)
    assert [cpu.native_bf16(f) for f in (AMX, AVX512_BF16, AVX512, AVX2)] == [1, 1, 0, 0]
    assert cpu.engine_dtype(AMX) == cpu.engine_dtype(AVX512_BF16) == "bfloat16"
    assert cpu.engine_dtype(AVX512) == cpu.engine_dtype(AVX2) == "float32"


def test_the_environment_overrides_the_choice(monkeypatch):
    monkeypatch.setenv(cpu.DTYPE_ENV, "bfloat16")
    assert cpu.engine_dtype(AVX2) == "bfloat16"
    monkeypatch.setenv(cpu.DTYPE_ENV, "")
    assert cpu.engine_dtype(AVX2) == "float32"
