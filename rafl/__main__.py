from rafl.cli import main

main()
