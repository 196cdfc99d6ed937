"""Learning the TreeGraft scheduler: cost profiles (``profile``), the offline value system (``collect``),
the distilled MLP (``distill``) and replay of policies under other cost profiles. No CLI code here."""
