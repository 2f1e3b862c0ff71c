from tracesynth.cli import main

main()
