from gnsweep.cli import main

main()
