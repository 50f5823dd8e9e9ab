"""Reading compiled programs: their HLO, collectives and ring formulas."""
