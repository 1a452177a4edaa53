from edgebus.cli import main

main()
