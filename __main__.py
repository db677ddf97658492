from elastic.cli.main import main

main()
