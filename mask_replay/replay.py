"""Replay on the trainer side (placeholder until the replay ops land)."""


def replay_logprobs(*args, **kwargs):
    raise NotImplementedError


def replay_logprobs_from_hidden(*args, **kwargs):
    raise NotImplementedError


def full_logprobs(*args, **kwargs):
    raise NotImplementedError


def kept_mass(*args, **kwargs):
    raise NotImplementedError
