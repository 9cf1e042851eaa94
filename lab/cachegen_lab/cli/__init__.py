"""The lab's ``cachegen`` subcommands."""
