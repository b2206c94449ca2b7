"""Private helpers shared by the strategies, plugins and callbacks."""
