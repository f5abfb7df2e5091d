"""The paper's single-stream efficiency tables (Appendix C; Llama-3.1-8B on an A6000 48 GB, three
agents, 128 generated tokens per agent): Table 11 (peak GPU memory, GB) and Table 12 (reuse-request
TTFT, s, and trajectory throughput, tokens/s) by shared context and reuse ratio rho; Table 13 (anchor
pool capacity V at 32K); Tables 14 and 15 (agents N and rounds R at 32K: TTFT, throughput, memory).
KVComm's Table 11 memory is the paper's estimate (it did not fit: its dagger); "oom" is None.
"""

from __future__ import annotations

from kvbench.analysis.paper.methods import METHOD_NAMES

RHO_COLUMNS = (0.95, 0.9, 0.8, 0.7, 0.6)  # Tables 11 and 12
CONTEXTS = {"2K": 2048, "8K": 8192, "32K": 32768}
ESTIMATED = {"kvcomm"}  # Table 11: estimated from its full-dimensional anchor states, not measured

_TABLE11 = """2K NonShared 16.9 16.9 16.9 16.9 16.9
2K FullShared 16.4 16.4 16.4 16.4 16.4
2K DroidSpeak 17.0 17.0 17.0 17.1 17.2
2K CacheBlend 17.2 17.2 17.2 17.3 17.4
2K RelayCaching 17.4 17.4 17.4 17.5 17.5
2K KVComm 42.3 42.3 42.3 42.3 42.3
2K GraphFlow 16.8 16.8 16.8 16.8 16.8
2K KVCMAS 17.1 17.1 17.1 17.1 17.1
8K NonShared 19.8 19.8 19.8 19.8 19.8
8K FullShared 17.9 17.9 17.9 17.9 17.9
8K DroidSpeak 19.3 19.3 19.5 19.8 20.0
8K CacheBlend 19.4 19.5 19.7 19.9 20.1
8K RelayCaching 19.6 19.7 19.8 19.9 20.0
8K KVComm 120.9 120.9 120.9 120.9 120.9
8K GraphFlow 19.1 19.1 19.1 19.1 19.1
8K KVCMAS 19.5 19.5 19.5 19.5 19.5
32K NonShared 31.5 31.5 31.5 31.5 31.5
32K FullShared 24.0 24.0 24.0 24.0 24.0
32K DroidSpeak 28.6 28.7 29.5 30.6 31.4
32K CacheBlend 28.5 28.9 29.7 30.5 31.3
32K RelayCaching 28.5 28.7 29.1 29.5 29.9
32K KVComm 435.6 435.6 435.6 435.6 435.6
32K GraphFlow 28.9 28.9 28.9 28.9 28.9
32K KVCMAS 29.2 29.2 29.2 29.2 29.2"""

# Table 12: five TTFT columns, then five throughput columns (rho as RHO_COLUMNS).
_TABLE12 = """2K NonShared 0.51 0.51 0.51 0.51 0.51 900 900 900 900 900
2K FullShared 0.16 0.16 0.16 0.16 0.16 1004 1004 1004 1004 1004
2K DroidSpeak 0.62 0.62 0.62 0.62 0.62 868 868 866 866 863
2K CacheBlend 0.40 0.42 0.44 0.46 0.48 935 933 920 917 906
2K RelayCaching 0.46 0.48 0.49 0.51 0.52 911 911 908 900 897
2K GraphFlow 0.31 0.33 0.37 0.40 0.43 941 939 935 919 916
2K KVCMAS 0.33 0.33 0.33 0.35 0.37 947 947 942 936 927
8K NonShared 1.58 1.58 1.58 1.58 1.58 1836 1836 1836 1836 1836
8K FullShared 0.51 0.51 0.51 0.51 0.51 2162 2162 2162 2162 2162
8K DroidSpeak 1.66 1.64 1.63 1.64 1.64 1826 1826 1826 1823 1823
8K CacheBlend 0.82 0.89 1.03 1.18 1.34 2067 2040 2009 1956 1899
8K RelayCaching 1.01 1.05 1.13 1.21 1.28 2011 1997 1972 1946 1927
8K GraphFlow 0.75 0.81 0.94 1.08 1.19 1707 1687 1666 1631 1614
8K KVCMAS 0.72 0.74 0.85 0.94 1.01 2098 2083 2052 2010 1989
32K NonShared 8.14 8.14 8.14 8.14 8.14 2709 2709 2709 2709 2709
32K FullShared 2.61 2.61 2.61 2.61 2.61 4564 4564 4564 4564 4564
32K DroidSpeak 8.00 8.03 8.01 8.04 8.04 2743 2743 2743 2734 2733
32K CacheBlend 3.85 4.46 5.70 6.87 8.02 4009 3754 3325 2995 2735
32K RelayCaching 4.34 4.70 5.22 5.84 6.42 3818 3674 3491 3296 3135
32K GraphFlow 3.75 4.09 4.76 5.41 6.08 3513 3370 3204 3034 2853
32K KVCMAS 3.27 3.52 4.02 4.52 5.01 4174 4146 3780 3524 3234"""

# Table 13: V, TTFT (s), throughput (tokens/s), memory (GB), MMLU accuracy (%), Video-MME accuracy (%).
_TABLE13 = """1 2.69 4050 26.21 62.51 49.40
5 3.93 3821 26.68 64.42 51.89
10 4.02 3780 29.24 65.45 52.36
20 4.05 3769 31.94 65.80 53.15"""

# Tables 14 and 15: TTFT (s) at 2/4/8, throughput (tokens/s) at 2/4/8, memory (GB) at 2/4/8.
_TABLE14 = """NonShared 8.25 8.37 oom 2729 2760 oom 27.25 35.63 oom
FullShared 3.87 2.01 1.08 3830 4922 5904 23.06 23.06 23.06
DroidSpeak 6.82 6.19 5.91 2657 2852 3021 27.12 27.93 29.64
CacheBlend 5.63 4.49 3.90 3627 3900 4153 27.03 27.79 29.54
RelayCaching 5.53 4.28 3.65 3480 3883 4093 26.61 27.22 28.44
GraphFlow 5.71 3.97 3.10 3075 3860 4244 28.80 29.82 31.86
KVCMAS 5.11 3.50 2.70 3546 4327 4776 29.07 29.39 30.03"""
_TABLE15 = """NonShared 8.22 8.33 8.19 2728 2747 2769 31.44 31.44 31.44
FullShared 1.39 0.74 0.43 5421 6445 6948 23.06 23.06 23.06
DroidSpeak 5.87 5.61 5.54 2756 2777 2805 27.66 27.75 28.03
CacheBlend 4.03 3.57 3.36 3927 4110 4278 27.50 27.65 27.90
RelayCaching 3.75 3.37 3.08 3824 3972 4138 27.00 27.16 27.38
GraphFlow 3.04 2.48 2.21 3926 4248 4582 29.36 29.52 29.70
KVCMAS 2.87 2.30 2.02 4198 4485 4802 29.33 29.49 29.77"""
SCALING_STEPS = (2, 4, 8)


def _number(text: str) -> float | None:
    return None if text == "oom" else float(text)


def table11_values() -> dict[tuple[str, int, float], float]:
    """(method, shared_tokens, rho) -> peak GPU memory (GB)."""
    values = {}
    for line in _TABLE11.splitlines():
        context, name, *numbers = line.split()
        for rho, number in zip(RHO_COLUMNS, numbers):
            values[(METHOD_NAMES[name], CONTEXTS[context], rho)] = float(number)
    return values


def table12_values() -> dict[tuple[str, int, str, float], float]:
    """(method, shared_tokens, "ttft_s" | "throughput_tok_s", rho) -> value."""
    values = {}
    for line in _TABLE12.splitlines():
        context, name, *numbers = line.split()
        for index, number in enumerate(numbers):
            metric = "ttft_s" if index < len(RHO_COLUMNS) else "throughput_tok_s"
            values[(METHOD_NAMES[name], CONTEXTS[context], metric, RHO_COLUMNS[index % len(RHO_COLUMNS)])] = float(number)
    return values


TABLE13_METRICS = ("ttft_s", "throughput_tok_s", "memory_gb", "mmlu_accuracy", "video_mme_accuracy")


def table13_values() -> dict[tuple[int, str], float]:
    """(V, metric) -> value."""
    return {(int(v), metric): float(number) for line in _TABLE13.splitlines()
            for v, *numbers in [line.split()] for metric, number in zip(TABLE13_METRICS, numbers)}


SCALING_METRICS = ("ttft_s", "throughput_tok_s", "memory_gb")


def _scaling(block: str) -> dict[tuple[str, str, int], float | None]:
    values = {}
    for line in block.splitlines():
        name, *numbers = line.split()
        for index, number in enumerate(numbers):
            metric, step = SCALING_METRICS[index // 3], SCALING_STEPS[index % 3]
            values[(METHOD_NAMES[name], metric, step)] = _number(number)
    return values


def table14_values() -> dict[tuple[str, str, int], float | None]:
    """(method, metric, agents N) -> value (None: out of memory)."""
    return _scaling(_TABLE14)


def table15_values() -> dict[tuple[str, str, int], float | None]:
    """(method, metric, rounds R) -> value."""
    return _scaling(_TABLE15)
