if __name__ == "__main__":
    # Imported here, not at the top: a process that multiprocessing spawns from
    # `python -m fp8_lightning` re-imports this module as `__mp_main__`, and must not import the
    # CLI (Lightning, the whole package) just to run a prepare worker.
    from .cli import main

    main()
