"""Tests of mask_replay.integrations.verl: the pure layout here (main suite), the real verl 0.9.1 ones in
test_trainer.py (skipped without verl; `make check-verl`)."""
