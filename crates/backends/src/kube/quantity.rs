//! Kubernetes resource quantities (`64`, `63500m`, `527951872Ki`, `1.5Gi`,
//! `1e9`) read as integers. k8s-openapi keeps them as strings; the node's
//! allocatable CPU and memory arrive in any of these spellings.

/// A quantity in thousandths of its unit (milli-cores for CPU, milli-bytes
/// for memory), or `None` when it is not a quantity or does not fit.
/// Fractions below a thousandth round down, as the API server does when it
/// canonicalises a quantity.
pub fn milli(q: &str) -> Option<u128> {
    let q = q.trim();
    let split = q
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+'))
        .unwrap_or(q.len());
    let (number, suffix) = q.split_at(split);
    let number = number.strip_prefix('+').unwrap_or(number);
    if number.is_empty() || number.starts_with('.') && number.len() == 1 {
        return None;
    }
    let (whole, frac) = match number.split_once('.') {
        Some((w, f)) => (w, f),
        None => (number, ""),
    };
    if !whole.bytes().all(|b| b.is_ascii_digit()) || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let digits = format!("{whole}{frac}");
    let mantissa: u128 = digits.parse().ok()?;
    let frac_len = i32::try_from(frac.len()).ok()?;
    // value = mantissa * 10^-frac_len * multiplier; we want value * 1000.
    let (binary, decimal_exp): (u128, i32) = match suffix {
        "" => (1, 0),
        "n" => (1, -9),
        "u" => (1, -6),
        "m" => (1, -3),
        "k" => (1, 3),
        "M" => (1, 6),
        "G" => (1, 9),
        "T" => (1, 12),
        "P" => (1, 15),
        "E" => (1, 18),
        "Ki" => (1 << 10, 0),
        "Mi" => (1 << 20, 0),
        "Gi" => (1 << 30, 0),
        "Ti" => (1 << 40, 0),
        "Pi" => (1 << 50, 0),
        "Ei" => (1 << 60, 0),
        s if s.starts_with(['e', 'E']) => (1, s[1..].parse::<i32>().ok()?),
        _ => return None,
    };
    let exp = decimal_exp + 3 - frac_len;
    let scaled = mantissa.checked_mul(binary)?;
    if exp >= 0 {
        scaled.checked_mul(10u128.checked_pow(u32::try_from(exp).ok()?)?)
    } else {
        let div = 10u128.checked_pow(u32::try_from(-exp).ok()?)?;
        Some(scaled / div)
    }
}

/// A whole-unit quantity (a count of devices), rounded down.
pub fn count(q: &str) -> Option<u64> {
    milli(q).and_then(|m| u64::try_from(m / 1000).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_every_spelling_the_api_server_emits() {
        assert_eq!(milli("64"), Some(64_000));
        assert_eq!(milli("63500m"), Some(63_500));
        assert_eq!(milli("0.5"), Some(500));
        assert_eq!(milli("1.5Gi"), Some(1_610_612_736_000));
        assert_eq!(milli("527951872Ki"), Some(527_951_872 * 1024 * 1000));
        assert_eq!(milli("1e3"), Some(1_000_000));
        assert_eq!(milli("500M"), Some(500_000_000_000));
        assert_eq!(milli("100n"), Some(0));
        assert_eq!(count("8"), Some(8));
        assert_eq!(count("7"), Some(7));
    }

    #[test]
    fn refuses_what_is_not_a_quantity() {
        for bad in [
            "",
            "abc",
            "1Qi",
            ".",
            "1.2.3",
            "-1",
            "1e",
            "99999999999999999999999999999999999999999Ei",
        ] {
            assert_eq!(milli(bad), None, "{bad}");
        }
    }
}
