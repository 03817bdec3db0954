from mask_replay.cli.main import main

main()
