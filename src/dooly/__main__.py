from dooly.cli import main

main()
