"""What every layer shares and nothing in meshkit sits below: errors, tree walking, seeding, atomic files."""
