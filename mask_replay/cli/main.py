"""Placeholder until the CLI lands."""
import click


@click.group()
def main():
    """mask-replay"""
