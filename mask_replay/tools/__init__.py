"""The work behind each command, callable without click (cli/ only parses flags and prints).

capture, score, inspect, convert, demo, example, plots, resume (skip finished outputs), torchrun and
launch (rows split across ranks).
"""
