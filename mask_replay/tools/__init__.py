"""The work behind each command, callable without click (cli/ only parses flags and prints).

capture, score, inspect, convert, demo, example, plots, selftest (every op on a device against the CPU
kernels, or the CPU kernels against reference.py's float64 PyTorch references), resume (skip finished
outputs), torchrun and launch (rows split across ranks).
"""
